"""Command line: ``python -m aiogpu info | demo | bench | stress``.

Exit status: 0 when the command succeeded, 1 when it found a problem (a mismatch, a leak, ...),
130 after Ctrl-C (reported in one line on stderr).
"""
from __future__ import annotations

import argparse
import ctypes
import sys


def info(args: argparse.Namespace) -> int:
    """The backend, why it was chosen, and each agent with its pools, queues and engines."""
    from .cli import closing
    from .runtime import Runtime
    from .hsa_bindings import types as T

    rt = Runtime(args.backend)
    with closing(rt):
        print(f"backend: {rt.backend}")
        print(f"reason:  {rt.reason}")
        if rt.backend == "cuda":
            for dev in rt.devices:
                print(f"device {dev.name}: {dev.product} ({dev.isa})")
                print(f"    streams: {', '.join(lane.name for lane in dev.lanes)}")
                print(f"    stream memory operations: {'yes' if dev.memops else 'no (events)'}")
            return 0
        optional = "all present" if not rt.api.missing else "absent: " + ", ".join(rt.api.missing)
        print(f"optional HSA calls: {optional}")
        for agent in rt.all_agents():
            print(_describe_agent(rt, agent, T))
            for dev in rt.devices:
                if dev.agent.handle == agent.handle:
                    print(f"    queues: {', '.join(f'{q.name} (ring {q.size})' for q in dev.queues)}")
                    engines = dev.engines.free_engines(agent, agent)
                    print(f"    SDMA engines free: {len(engines)}"
                          + ("" if rt.api.has_engine_copy else " (library lacks engine calls: shader copies)"))
    return 0


def _describe_agent(rt, agent, T) -> str:
    api = rt.api
    kind = ctypes.c_uint32()
    api.hsa_agent_get_info(agent, T.HSA_AGENT_INFO_DEVICE, ctypes.byref(kind))
    product = ctypes.create_string_buffer(64)
    api.hsa_agent_get_info(agent, T.HSA_AMD_AGENT_INFO_PRODUCT_NAME, product)
    kind_name = {T.HSA_DEVICE_TYPE_CPU: "CPU", T.HSA_DEVICE_TYPE_GPU: "GPU"}.get(kind.value, "DSP")
    lines = [f"agent {rt.agent_name(agent)} [{kind_name}] {product.value.decode(errors='replace')}"]
    for pool, flags in rt.pools(agent):
        size = ctypes.c_size_t()
        api.hsa_amd_memory_pool_get_info(pool, T.HSA_AMD_MEMORY_POOL_INFO_SIZE, ctypes.byref(size))
        kinds = [n for bit, n in ((1, "kernarg"), (2, "fine-grained"), (4, "coarse-grained")) if flags & bit]
        lines.append(f"    pool {'/'.join(kinds)}: {size.value / 2**30:.1f} GiB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aiogpu", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="backend, agents, pools, queues, engines")
    p.add_argument("--backend", default=None)
    p.set_defaults(run=info)
    p = sub.add_parser("demo", help="a two-GPU pipeline, checked against NumPy")
    p.add_argument("--backend", default=None)
    p.add_argument("--batches", type=int, default=16)
    p.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace JSON here")
    p.set_defaults(run=lambda a: _lazy("demo", a))
    p = sub.add_parser("bench", help="aiogpu against what users do today")
    p.add_argument("--backend", default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None, help="write the results as JSON here")
    p.set_defaults(run=lambda a: _lazy("bench", a))
    p = sub.add_parser("stress", help="random GPU work under injected faults, checked against NumPy")
    p.add_argument("--quick", action="store_true", help="about 10,000 operations (< 2 minutes)")
    p.add_argument("--ops", type=int, default=None)
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    p.set_defaults(run=lambda a: _lazy("stress", a))
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        # Ctrl-C: one line and the shell's status for SIGINT (128 + 2), not a traceback.
        print("aiogpu: interrupted", file=sys.stderr, flush=True)
        return 130


def _lazy(name: str, args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(f"aiogpu.cli.{name}")
    return module.run(args)


if __name__ == "__main__":
    sys.exit(main())
