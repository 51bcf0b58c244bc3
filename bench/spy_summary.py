"""Where the service's event-loop thread spends its time: a summary of a py-spy recording of
``bench/serve.py`` (``py-spy record --threads --subprocesses --format raw``), the server
process's main thread only (the load process and the parent are left out).

    python bench/spy_summary.py out/spy_aiogpu_trivial_all.txt          # from bench/spy_serve.sh
    python bench/spy_summary.py --top 30 A.txt B.txt                    # two trees, one after the other

On the fake CUDA driver (host cost only: the fake runs no kernel, so serve.py counts every
answer wrong), one recording per tree, run from that tree's root:

    LD_LIBRARY_PATH=$(python tests/fakes/libcuda/build_libcuda.py) PYTHONPATH=tests/fakes:. \\
        py-spy record --threads --subprocesses --rate 200 --format raw -o spy.txt -- \\
        python bench/serve.py --backend cuda --modes aiogpu --work trivial --repeat 1 --duration 8

Shares are of the loop thread's samples, idle included (uvloop's run loop waiting in epoll shows
as the self time of ``Runner.run``); compiled code shows as the Python frame that called it.
"""
from __future__ import annotations

import argparse
import collections
import re

_LOCATION = re.compile(r" \(([^()]*?):\d+\)$")


def frame_name(frame: str) -> str:
    """``fn (path/to/file.py:12)`` as ``fn (file.py)``: one entry per function, not per line."""
    return _LOCATION.sub(lambda m: f" ({m.group(1).rsplit('/', 1)[-1]})", frame)


def summarise(path: str) -> tuple[int, collections.Counter, collections.Counter]:
    """(samples, inclusive counts, self counts) of the server's loop thread in ``path``."""
    inclusive: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            # process (parent); process (server: "--serve"); thread; frames...
            if len(frames) < 4 or "--serve" not in frames[1] or "MainThread" not in frames[2]:
                continue
            n = int(count)
            total += n
            names = [frame_name(fr) for fr in frames[3:]]
            for name in set(names):
                inclusive[name] += n
            own[names[-1]] += n
    return total, inclusive, own


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recordings", nargs="+")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    for path in args.recordings:
        total, inclusive, own = summarise(path)
        print(f"{path}: {total} samples of the server's loop thread")
        if not total:
            continue
        print("  inclusive:")
        for name, n in inclusive.most_common(args.top):
            print(f"    {100 * n / total:5.1f}%  {name}")
        print("  self:")
        for name, n in own.most_common(args.top):
            print(f"    {100 * n / total:5.1f}%  {name}")


if __name__ == "__main__":
    main()
