"""Multi-GPU validation run: peer copies, a two-GPU graph, the demo pipeline and the loader.

    python bench/multi_gpu.py OUT.json          # on a machine with two or more GPUs

Peer copy bandwidth GPU0->GPU1 and GPU1->GPU0 through aiogpu against raw cuMemcpyPeerAsync (CUDA),
with the stream or engine each aiogpu copy ran on (it must be the SOURCE device's); a two-GPU graph
replay; the demo pipeline and the loader over all GPUs against one GPU. Works on the emulator too
(the raw rows are then absent).
"""
from __future__ import annotations

import asyncio
import json
import sys
import time

import aiogpu
from aiogpu.cli.bench import loader_throughput, two_device_graph
from aiogpu.cli.demo import pipeline

async def peer(devs, nbytes, reps, res, rt):
    for s, d in ((0, 1), (1, 0)):
        a, b = devs[s].alloc(nbytes), devs[d].alloc(nbytes)
        await aiogpu.copy(b, a)
        t = time.perf_counter()
        futs = [aiogpu.copy(b, a) for _ in range(reps)]
        await aiogpu.gather(*futs)
        res[f"peer_{s}to{d}_GBs_aiogpu"] = reps * nbytes / (time.perf_counter() - t) / 1e9
        res[f"peer_{s}to{d}_ran_on"] = sorted({f.queue for f in futs})
        if rt.backend == "cuda":
            res[f"peer_{s}to{d}_GBs_raw"] = raw_peer(devs[s], devs[d], a, b, nbytes, reps)


def raw_peer(src, dst, a, b, nbytes, reps):
    from cuda.bindings import driver as cu

    src.make_current()
    _, stream = cu.cuStreamCreate(1)
    copy = lambda: cu.cuMemcpyPeerAsync(b.address, dst.ctx, a.address, src.ctx, nbytes, stream)  # noqa: E731
    copy()
    cu.cuStreamSynchronize(stream)
    t = time.perf_counter()
    for _ in range(reps):
        copy()
    cu.cuStreamSynchronize(stream)
    bw = reps * nbytes / (time.perf_counter() - t) / 1e9
    cu.cuStreamDestroy(stream)
    return bw


def main(path: str) -> int:
    rt = aiogpu.Runtime()
    devs = rt.devices
    res: dict = {"backend": rt.backend, "reason": rt.reason, "gpus": len(devs)}
    big = rt.backend == "cuda"
    try:
        if len(devs) < 2:
            print(f"needs two GPUs; {rt.backend} has {len(devs)}")
            return 1
        asyncio.run(peer(devs, (1 << 30) if big else (8 << 20), 10 if big else 4, res, rt))
        res["graph2_replay_us_per_node"] = asyncio.run(two_device_graph(devs, 50 if big else 5))
        for label, use in (("all", devs), ("one", devs[:1])):
            summary = asyncio.run(pipeline(rt, 64 if big else 16, devices=use))
            res[f"demo_{label}_gpus_ops_per_s"] = summary["ops"] / summary["seconds"]
            res[f"demo_{label}_gpus_mismatches"] = summary["mismatches"]
            res[f"demo_{label}_gpus_copies"] = summary["copies"]
            lt = asyncio.run(loader_throughput(use, 64 if big else 16, (1 << 24) if big else (1 << 18),
                                               iters=1500))
            res[f"loader_{label}_gpus_batches_per_s"] = lt["loader_pipelined_batches_per_s"]
    finally:
        rt.close()
    for k, v in res.items():
        print(f"{k:40s} {v:.1f}" if isinstance(v, float) else f"{k:40s} {v}")
    with open(path, "w") as fh:
        json.dump(res, fh, indent=2)
    ok = all(res.get(f"demo_{x}_gpus_mismatches", 1) == 0 for x in ("all", "one"))
    ok = ok and all(r.startswith(f"gpu{s}.") for s, d in ((0, 1), (1, 0)) for r in res[f"peer_{s}to{d}_ran_on"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "multi_gpu.json"))
