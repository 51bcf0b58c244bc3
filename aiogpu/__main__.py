"""Command line: ``aiogpu info | demo | bench | stress`` (also ``python -m aiogpu ...``).

Exit status: 0 when the command succeeded, 1 when it found a problem (a mismatch, a leak, ...),
2 for a usage error (one line on stderr), 130 after Ctrl-C (reported in one line on stderr).
"""
from __future__ import annotations

import argparse
import sys

from . import __version__
from .errors import BackendUnavailable


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aiogpu", description=__doc__)
    parser.add_argument("--version", action="version", version=f"aiogpu {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="backend, agents, pools, queues, engines")
    p.add_argument("--backend", default=None)
    p.set_defaults(run=lambda a: _lazy("info", a))
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
    p.add_argument("--backend", default="emulator", choices=("emulator", "hsa-virtual"),
                   help="emulator (with injected faults) or hsa-virtual (the real ROCr, no faults)")
    p.set_defaults(run=lambda a: _lazy("stress", a))
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (BackendUnavailable, _BadBackend) as exc:     # a usage error: one line, exit 2
        print(f"aiogpu {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C: one line and the shell's status for SIGINT (128 + 2), not a traceback.
        print("aiogpu: interrupted", file=sys.stderr, flush=True)
        return 130


class _BadBackend(ValueError):
    """Raised for an unknown backend name (see ``_lazy``)."""


def _lazy(name: str, args: argparse.Namespace) -> int:
    import importlib

    from .runtime import resolve_backend

    if getattr(args, "backend", None) is not None:
        try:
            resolve_backend(args.backend)
        except ValueError as exc:
            raise _BadBackend(str(exc)) from None
    module = importlib.import_module(f"aiogpu.cli.{name}")
    return module.run(args)


if __name__ == "__main__":
    sys.exit(main())
