"""Host cost per operation, without a profiler's distortion, for five shapes of work:

- ``submit``: ``dev.launch`` of a no-op kernel, nothing awaited;
- ``submit_loop``: the same from a coroutine on a running uvloop (as a service submits: the
  SIGINT hold's handler swap is paid once per loop iteration there, not per launch);
- ``await1``: one task awaiting each launch in turn (uvloop);
- ``buffers``: launches with two buffer arguments (the hazard path), nothing awaited;
- ``service``: what bench/serve.py's handler does, minus aiohttp: two allocs, an upload from a
  fresh array, a launch, ``await to_numpy``, two frees.

Three more shapes, not run unless named in ``--shapes``, are the service request cut short, to
say where its cost goes (subtract each from the next): ``service_allocs`` (the two allocs and
frees, with ``await asyncio.sleep(0)`` in place of the download), ``service_upload`` (and the
upload, not awaited), ``service_launch`` (and the launch); ``service`` is all of it.

Per shape: Python and C function calls per operation on the calling thread (close to
deterministic: they moved by up to 4% between runs of one tree on the fake driver), the best
CPU time per operation over 7 runs of the calling thread and of the whole process (the waiter
thread included), and the waiter's wake-ups per operation (each a syscall and a scan under the
GIL that the loop does not see in its own CPU time). With ``--callgrind``: instructions per
operation of the calling thread from valgrind's callgrind, which a loaded machine does not move:
each shape runs N operations, and in a second process 3N, after the same warm-up, callgrind
counting only the operations (``--toggle-collect`` on the region ``run_once`` marks):
(I(3N) - I(N)) / 2N. Here that count moved by 1.4% (submit) and 7% (service; in six later runs 184k-241k) between runs
of one tree: an ``await`` spins on the completion for a window it adapts in wall-clock time,
which valgrind stretches 50x, so how often it spins (cheap) or parks (a loop wake-up) moves.
``--spin-s 0`` (every await parks) gives a count that moved by 0.1% in three runs on an idle
machine; else use ``--repeat`` (the A/B compares each tree's lowest). Other load on the
machine (a test suite beside it) moved that count by up to 20%: the waiter thread then gets
the GIL at other times, so the calling thread retires (and frees) more or less of the work
itself. The whole process's count
moved by 5-60%, as under valgrind the waiter thread's timed wake-ups follow the stretched
wall clock, so the waiter is left out of it (its cost is in the timed runs' process column).

    python bench/hostcost.py --backend cuda                 # this tree, on the driver installed
    python bench/hostcost.py --fake                          # the fake CUDA driver, C hot path
    python bench/hostcost.py --fake --hot bindings           # the same, on the cuda-bindings path
    python bench/hostcost.py --fake --ab OLD_TREE            # A/B: OLD_TREE's aiogpu and this one's
    python bench/hostcost.py --fake --ab OLD_TREE --callgrind --repeat 2 --shapes submit,service

``--fake`` runs each measurement in a child process on the fake driver of this tree (the fake
``cuda.bindings`` and the fake ``libcuda.so.1`` that tests/fakes/libcuda/build_libcuda.py
builds on demand with the C compiler), so that aiogpu's C hot path (``aiogpu.cuda._hotc``, built
with ``python -m aiogpu.cuda.build_hotc`` where missing) runs as on a GPU; the child says
which hot path it used. By hand, the same is::

    LD_LIBRARY_PATH=$(python tests/fakes/libcuda/build_libcuda.py) \\
        PYTHONPATH=tests/fakes:. python bench/hostcost.py --backend cuda

``--ab OLD_TREE`` (a checkout of the commit to compare with, e.g. ``git worktree add --detach
../old COMMIT`` or ``git archive COMMIT | tar -x -C ../old``) runs this script on OLD_TREE's
aiogpu and on this tree's, alternating, ``--rounds`` times each (best of all its runs per
tree), on the same fake driver, and prints both with the ratio new/old. ``--callgrind`` needs
valgrind; ``--n`` defaults to 200 operations there.
"""
from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SHAPES = ("submit", "submit_loop", "await1", "buffers", "service")
SERVICE_PARTS = ("service_allocs", "service_upload", "service_launch")
ALL_SHAPES = SHAPES + SERVICE_PARTS
NOOP_CUDA = 'extern "C" __global__ void noop(unsigned n) {}'
K2_CUDA = 'extern "C" __global__ void k2(float* a, const float* b, unsigned n) {}'


def noop(launch, n):
    pass


def k2(launch, a, b, n):
    a[:n] = 2 * b[:n] + 1


def make_shapes(rt) -> dict:
    """Each shape as a function of the number of operations it runs."""
    import asyncio

    import numpy as np
    import uvloop

    import aiogpu

    cuda = rt.backend == "cuda"
    k = aiogpu.kernel("u32", cuda=NOOP_CUDA if cuda else None, name="noop")(noop)
    kb = aiogpu.kernel("f32*, const f32*, u32", cuda=K2_CUDA if cuda else None, name="k2")(k2)
    dev = rt.devices[0]

    def submit(n: int) -> None:
        futs = [dev.launch(k, (1,), (1,), (0,)) for _ in range(n)]
        futs[-1].wait(60)

    def submit_loop(n: int) -> None:
        async def go() -> None:
            futs = [dev.launch(k, (1,), (1,), (0,)) for _ in range(n)]
            await futs[-1]
        uvloop.run(go())

    def await1(n: int) -> None:
        async def go() -> None:
            for _ in range(n):
                await dev.launch(k, (1,), (1,), (0,))
        uvloop.run(go())

    def buffers(n: int) -> None:
        x, y = dev.alloc(4096), dev.alloc(4096)
        futs = [dev.launch(kb, (1,), (1,), (x, y, 0)) for _ in range(n)]
        futs[-1].wait(60)
        x.free()
        y.free()

    def service_up_to(stage: int):
        """The service request up to ``stage``: 1 the allocs and frees, 2 and the upload, 3 and
        the launch (each with one loop turn in place of the download), 4 all of it."""
        def run(n: int) -> None:
            async def go() -> None:
                host = np.ones(256, np.float32)
                for _ in range(n):
                    x, y = dev.alloc(1024), dev.alloc(1024)
                    if stage >= 2:
                        aiogpu.copy(x, host)
                    if stage >= 3:
                        dev.launch(kb, (256,), (256,), (y, x, 256))
                    if stage == 4:
                        await y.to_numpy(np.float32)
                    else:
                        await asyncio.sleep(0)
                    x.free()
                    y.free()
            uvloop.run(go())
        return run

    return {"submit": submit, "submit_loop": submit_loop, "await1": await1, "buffers": buffers, "service": service_up_to(4),
            **{name: service_up_to(stage) for stage, name in enumerate(SERVICE_PARTS, 1)}}


def hot_path(rt) -> str:
    for line in rt.describe().splitlines():
        if line.startswith("hot path:"):
            return line[len("hot path:"):].strip()
    return "-"


def core_state() -> str:
    """Whether aiogpu's core runs compiled here ("compiled", "interpreted", or what is mixed):
    a stale build runs interpreted, so an A/B says which one it measured."""
    try:
        from aiogpu._core import summary
    except ImportError:                      # (a tree from before the compiled core)
        return "no compiled core"
    return summary().split(" (")[0].removeprefix("core: ")


def _options() -> dict:
    """The runtime's options of a worker: ``spin_s`` from ``--spin-s`` (HOSTCOST_SPIN_S)."""
    spin = os.environ.get("HOSTCOST_SPIN_S")
    return {} if spin is None else {"spin_s": float(spin)}


def measure(backend: str | None, shapes: list[str], n: int, runs: int) -> dict:
    """In this process: per shape, calls/op, best thread and process CPU us/op, wake-ups/op."""
    import aiogpu

    rt = aiogpu.Runtime(backend=backend, **_options())
    fns = make_shapes(rt)
    out = {"backend": rt.backend, "device": repr(rt.devices[0]), "hot": hot_path(rt), "core": core_state(),
           "aiogpu": os.path.dirname(aiogpu.__file__), "shapes": {}}
    count = [0]

    def prof(frame, event, arg) -> None:
        if event in ("call", "c_call"):
            count[0] += 1

    for name in shapes:
        fn = fns[name]
        fn(n)                                   # warm: kernels loaded, pools filled
        count[0] = 0
        sys.setprofile(prof)
        fn(n)
        sys.setprofile(None)
        hub = getattr(rt, "hub", None)
        woke = getattr(hub, "wakeups", 0)
        thread, proc = [], []
        for _ in range(runs):
            t, p = time.thread_time(), time.process_time()
            fn(n)
            thread.append((time.thread_time() - t) / n * 1e6)
            proc.append((time.process_time() - p) / n * 1e6)
        wakeups = (getattr(hub, "wakeups", 0) - woke) / (runs * n)
        out["shapes"][name] = {"calls": count[0] / n, "thread_us": min(thread), "process_us": min(proc),
                               "wakeups": wakeups}
    rt.close()
    return out


def run_once(backend: str | None, shape: str, n: int, warm: int) -> None:
    """In this process, for callgrind: the shape ``warm`` operations, then ``n``."""
    import aiogpu

    rt = aiogpu.Runtime(backend=backend, **_options())
    fn = make_shapes(rt)[shape]
    fn(warm)
    # The region callgrind counts (--toggle-collect=functools_reduce: the C function behind
    # functools.reduce, which nothing on aiogpu's paths calls): the n operations, not the
    # interpreter's start, the imports or the warm-up.
    functools.reduce(lambda _a, _b: fn(n), (0, 0))
    print(json.dumps({"hot": hot_path(rt), "core": core_state()}))
    rt.close()


def print_table(res: dict) -> None:
    print(f"host cost per operation on {res['backend']} ({res['device']}), hot path: {res['hot']}, "
          f"core: {res['core']}")
    for name, r in res["shapes"].items():
        print(f"  {name:8s} calls/op {r['calls']:7.1f}   best CPU us/op thread {r['thread_us']:8.2f}"
              f"  process {r['process_us']:8.2f}   waiter wake-ups/op {r['wakeups']:5.2f}")


# -- children on the fake driver --------------------------------------------------------------------
def fake_bindings_dir() -> str:
    """The folder holding this tree's fake ``cuda`` package (the one with ``cuGetProcAddress``)."""
    for path in sorted(glob.glob(os.path.join(ROOT, "tests/fakes/**/cuda/bindings/driver.py"), recursive=True)):
        return os.path.dirname(os.path.dirname(os.path.dirname(path)))
    sys.exit("hostcost: this tree has no fake cuda.bindings")


@functools.lru_cache(maxsize=None)
def fake_library_dir() -> str:
    """The fake libcuda.so.1's folder, built on demand."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "fakes", "libcuda", "build_libcuda.py")],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"hostcost: the fake libcuda.so.1 did not build:\n{proc.stderr}")
    return proc.stdout.strip()


def ensure_hotc(tree: str) -> None:
    """Build ``tree``'s C hot path where it is missing (git-ignored, beside its source)."""
    if glob.glob(os.path.join(tree, "aiogpu", "cuda", "_hotc*.so")):
        return
    proc = subprocess.run([sys.executable, "-m", "aiogpu.cuda.build_hotc"], cwd=tree, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": tree})
    if proc.returncode != 0:
        print(f"hostcost: {tree}'s C hot path did not build (it runs on the Python one):\n{proc.stderr}",
              file=sys.stderr)


def child_env(tree: str, hot: str | None) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([fake_bindings_dir(), tree]),
           "LD_LIBRARY_PATH": os.pathsep.join(p for p in (fake_library_dir(), os.environ.get("LD_LIBRARY_PATH")) if p),
           "PYTHONHASHSEED": "0"}
    env.pop("AIOGPU_CUDA_HOT", None)
    if hot:
        env["AIOGPU_CUDA_HOT"] = hot
    return env


def run_child(tree: str, hot: str | None, args: list[str], wrap: list[str] = ()) -> dict:
    cmd = [*wrap, sys.executable, os.path.abspath(__file__), "--worker", "--backend", "cuda", *args]
    proc = subprocess.run(cmd, env=child_env(tree, hot), capture_output=True, text=True, cwd=tree)
    if proc.returncode != 0:
        sys.exit(f"hostcost: {' '.join(cmd)} in {tree} failed:\n{proc.stdout}{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def callgrind_instructions(tree: str, hot: str | None, shape: str, n: int,
                           keep: str | None = None) -> tuple[float, str]:
    """Instructions per operation of ``shape`` in ``tree`` on the calling thread, and the hot
    path used. Only the region of the operations is counted (``run_once``); the waiter
    thread's instructions are not: under valgrind its timed wake-ups follow the wall clock,
    which a 50x slower run stretches, so that count is not the program's (its CPU time is in
    the timed runs' process column). ``keep``: a folder to leave callgrind's files in (named
    ``SHAPE.N-01`` and ``SHAPE.3N-01`` for the calling thread), for ``callgrind_annotate``."""
    if shutil.which("valgrind") is None:
        sys.exit("hostcost: --callgrind needs valgrind")
    counts, hot_name = [], "-"
    with tempfile.TemporaryDirectory() as tmp:
        for ops in (n, 3 * n):
            out_file = os.path.join(keep or tmp, f"{shape}.{ops}")
            res = run_child(tree, hot, ["--once", shape, "--n", str(ops), "--warm", str(n)],
                            wrap=["valgrind", "--tool=callgrind", "--separate-threads=yes",
                                  "--collect-atstart=no", "--toggle-collect=functools_reduce",
                                  f"--callgrind-out-file={out_file}"])
            hot_name = f"{res['hot'].split(' ')[0]}, core {res['core']}"
            path = out_file + "-01"                       # one file per thread: -01 is the main one
            if not os.path.exists(path):
                sys.exit(f"hostcost: callgrind wrote no {path}")
            with open(path) as f:
                m = re.search(r"^(?:summary|totals):\s*(\d+)", f.read(), re.M)
            if m is None:
                sys.exit(f"hostcost: no instruction total in {path}")
            counts.append(int(m.group(1)))
    return (counts[1] - counts[0]) / (2 * n), hot_name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default=None)
    ap.add_argument("--n", type=int, default=None, help="operations per run (2000; 200 with --callgrind)")
    ap.add_argument("--runs", type=int, default=7, help="timed runs per shape (the best counts)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of " + ", ".join(ALL_SHAPES))
    ap.add_argument("--fake", action="store_true", help="on the fake CUDA driver with its libcuda.so.1, in children")
    ap.add_argument("--hot", choices=("c", "bindings"), help="force this CUDA hot path (AIOGPU_CUDA_HOT)")
    ap.add_argument("--ab", metavar="OLD_TREE", help="also OLD_TREE's aiogpu, alternating (implies --fake)")
    ap.add_argument("--rounds", type=int, default=3, help="with --ab: runs of each tree, alternating")
    ap.add_argument("--callgrind", action="store_true", help="instructions per operation (valgrind; implies --fake)")
    ap.add_argument("--repeat", type=int, default=1, help="with --callgrind: measurements per tree and shape")
    ap.add_argument("--callgrind-dir", help="with --callgrind, one tree: keep callgrind's files there "
                    "(callgrind_annotate --inclusive=yes DIR/service.600-01)")
    ap.add_argument("--spin-s", type=float, help="the runtime's spin_s (default: its own); 0 with --callgrind "
                    "for a count that does not move: the adaptive spin follows the wall clock")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--once", help=argparse.SUPPRESS)
    ap.add_argument("--warm", type=int, default=200, help=argparse.SUPPRESS)
    a = ap.parse_args()
    shapes = [s for s in a.shapes.split(",") if s]
    bad = [s for s in shapes if s not in ALL_SHAPES]
    if bad:
        ap.error(f"unknown shapes {bad}: choose from {', '.join(ALL_SHAPES)}")
    n = a.n or (200 if a.callgrind else 2000)
    if a.spin_s is not None:
        os.environ["HOSTCOST_SPIN_S"] = str(a.spin_s)       # (the children inherit it)
    if a.callgrind_dir and (a.ab or not a.callgrind):
        ap.error("--callgrind-dir: with --callgrind, and without --ab (one tree's files)")
    if a.callgrind_dir:
        os.makedirs(a.callgrind_dir, exist_ok=True)
        a.callgrind_dir = os.path.abspath(a.callgrind_dir)
    if a.worker:
        if a.once:
            run_once(a.backend, a.once, n, a.warm)
        else:
            print(json.dumps(measure(a.backend, shapes, n, a.runs)))
        return
    if not (a.fake or a.ab or a.callgrind):
        if a.hot:
            os.environ["AIOGPU_CUDA_HOT"] = a.hot
        print_table(measure(a.backend, shapes, n, a.runs))
        return

    trees = [("new", ROOT)]
    if a.ab:
        old = os.path.abspath(a.ab)
        if not os.path.isdir(os.path.join(old, "aiogpu")):
            ap.error(f"--ab {a.ab}: no aiogpu package there")
        trees.insert(0, ("old", old))
    for _, tree in trees:
        ensure_hotc(tree)

    if a.callgrind:
        print(f"instructions per operation on the calling thread (callgrind, (I(3N)-I(N))/2N, N={n})")
        per: dict = {}
        for shape in shapes:
            for _ in range(a.repeat):
                for label, tree in trees:
                    ipo, hot = callgrind_instructions(tree, a.hot, shape, n, a.callgrind_dir)
                    per.setdefault((shape, label), []).append(ipo)
                    print(f"  {shape:8s} {label:3s} {ipo:10,.0f}   hot path {hot}   ({tree})",
                          flush=True)
            if a.ab:
                old, new = min(per[(shape, "old")]), min(per[(shape, "new")])
                print(f"  {shape:8s} new/old {new / old:.3f}")
        return

    best: dict = {}
    rounds = a.rounds if a.ab else 1
    for r in range(rounds):
        for label, tree in trees:
            res = run_child(tree, a.hot, ["--shapes", ",".join(shapes), "--n", str(n), "--runs", str(a.runs)])
            print(f"[round {r + 1} {label}] {tree}: hot path {res['hot']}, core {res['core']}", flush=True)
            keep = best.setdefault(label, res)
            for s, v in res["shapes"].items():
                k = keep["shapes"][s]
                k["thread_us"] = min(k["thread_us"], v["thread_us"])
                k["process_us"] = min(k["process_us"], v["process_us"])
    for label, _ in trees:
        print(f"{label}: ", end="")
        print_table(best[label])
    if a.ab:
        print("new/old (best CPU per operation):")
        for s in shapes:
            o, w = best["old"]["shapes"][s], best["new"]["shapes"][s]
            print(f"  {s:8s} calls {w['calls'] / o['calls']:.3f}   thread {w['thread_us'] / o['thread_us']:.3f}"
                  f"   process {w['process_us'] / o['process_us']:.3f}")


if __name__ == "__main__":
    main()
