"""Mutation score of the protocol core, per file: ``python tools/mutation_score.py [--sample N]``.

Runs ``mutmut`` (configured in pyproject.toml's ``[tool.mutmut]``: which tests run per mutant, and in
``only_mutate`` the one table of the files mutated, which this script reads too) over every mutant,
or over a seeded random sample of N mutants per file (the whole run takes hours on a 2-core
machine), then prints killed / checked per file and the mutants not killed. ``--seed 7,8,9``
runs the union of several seeds' samples in one mutmut run (one clean-test run, a mutant shared by
two samples checked once), then reports each sample on its own. A file's sample
depends only on the seed, the file's path and its mutants: the same with ``--only`` as without,
and unchanged when another file is added, changed or moved. A timeout
(the tests hung) or a crash (segfault) counts as killed; a mutant no selected test reaches counts
as survived. ``--report`` prints the last run's results only. Needs the ``mutation`` extra.

Each mutant not killed is listed with its reason from ``mutants_not_killed.toml`` beside this
script (why it is equivalent, or why it is left), or ``no reason recorded``. A reason names the
change its mutant makes (a ``+`` or ``-`` line of ``mutmut show``): mutmut numbers a function's
mutants anew when the function changes, so a reason whose mutant no longer makes that change is
reported as stale.
"""
from __future__ import annotations

import argparse
import collections
import pathlib
import random
import re
import signal
import subprocess
import sys
import tomllib

KILLED = {"killed", "timeout", "segfault"}
MUTMUT = [sys.executable, "-m", "mutmut"]     # the one installed beside this interpreter
REASONS = pathlib.Path(__file__).with_name("mutants_not_killed.toml")
PYPROJECT = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"


def files() -> dict[str, str]:
    """{module name as mutmut names its mutants: path}, from ``[tool.mutmut] only_mutate``."""
    with open(PYPROJECT, "rb") as f:
        paths = tomllib.load(f)["tool"]["mutmut"]["only_mutate"]
    return {path.removesuffix(".py").replace("/", "."): path for path in paths}


def results() -> dict[str, str]:
    """{mutant name: status} as mutmut reports them."""
    out = subprocess.run([*MUTMUT, "results", "--all", "true"], capture_output=True, text=True, check=True)
    return dict(re.findall(r"^\s*(\S+): (.+?)\s*$", out.stdout, re.M))


def sample(group: list[str], n: int, seed: int, path: str) -> list[str]:
    """``n`` of a file's mutants, drawn by a generator of that file's own (seeded by seed and path)."""
    return random.Random(f"{seed}:{path}").sample(sorted(group), min(n, len(group)))


def module(name: str) -> str:
    return name.split(".x", 1)[0]


def reasons() -> dict[str, dict[str, str]]:
    """{mutant name: {"change": mutated line, "why": reason}} from REASONS."""
    with open(REASONS, "rb") as f:
        return tomllib.load(f)


def reason_for(name: str, known: dict[str, dict[str, str]]) -> str:
    """Why ``name`` is not killed, if its recorded change is still a line of its diff."""
    entry = known.get(name)
    if entry is None:
        return "no reason recorded"
    diff = subprocess.run([*MUTMUT, "show", name], capture_output=True, text=True).stdout
    lines = {_change(line) for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")}
    if _change(entry["change"]) not in lines:
        return f"STALE (the mutant no longer makes the change {entry['change']!r}): {entry['why']}"
    return entry["why"]


def _change(line: str) -> str:
    """A diff line with its sign, whitespace-insensitive."""
    return line[0] + " ".join(line[1:].split())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sample", type=int, default=0, help="mutants per file (0: all)")
    ap.add_argument("--seed", default="13", help="the sample's seed, or several: 7,8,9 (one run, a report each)")
    ap.add_argument("--max-children", type=int, default=2)
    ap.add_argument("--only", default="", help="files whose path contains this, or one of several: hub,submit")
    ap.add_argument("--report", action="store_true", help="report the last run's results; run nothing")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seed.split(",")]
    # Ctrl-C's tests need SIGINT delivered; a shell starting this in the background ignores it,
    # and mutmut would inherit that. A handler of our own is reset to the default in mutmut.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if not args.report:     # mutmut generates the mutants, then refuses the unknown name
        subprocess.run([*MUTMUT, "run", "--max-children", "1", "__none__"], capture_output=True)
    table_of_files = files()
    only = args.only.split(",")
    names = sorted(n for n in results() if module(n) in table_of_files
                   and any(part in table_of_files[module(n)] for part in only))
    samples = {seed: names for seed in seeds}
    if args.sample:
        by_file = collections.defaultdict(list)
        for name in names:
            by_file[module(name)].append(name)
        samples = {seed: sorted(n for mod, group in by_file.items()
                                for n in sample(group, args.sample, seed, table_of_files[mod])) for seed in seeds}
    if not args.report:
        union = sorted({n for chosen in samples.values() for n in chosen})
        subprocess.run([*MUTMUT, "run", "--max-children", str(args.max_children), *union], check=False)
    status = results()
    known = reasons()
    for seed, chosen in samples.items():
        if len(samples) > 1 or args.sample:
            print(f"seed {seed}:" if args.sample else "all mutants:")
        _report(chosen, status, known, table_of_files)
    return 0


def _report(names: list[str], status: dict[str, str], known: dict[str, dict[str, str]],
            table_of_files: dict[str, str]) -> None:
    table = collections.defaultdict(collections.Counter)
    for name in names:
        table[module(name)][status.get(name, "not checked")] += 1
    total = collections.Counter()
    for mod, counts in sorted(table.items()):
        total.update(counts)
        print(_line(table_of_files[mod], counts))
    print(_line("overall", total))
    for name in names:
        if status.get(name) not in KILLED:
            why = "" if name not in status or status[name] == "not checked" else f"\n      {reason_for(name, known)}"
            print(f"  {status.get(name)}: {name}{why}")


def _line(what: str, counts: collections.Counter) -> str:
    killed = sum(counts[k] for k in KILLED)
    checked = sum(counts.values()) - counts["not checked"]
    score = 100.0 * killed / checked if checked else 0.0
    return f"{what:24} {killed:4}/{checked:<4} killed ({score:.1f}%)  {dict(counts)}"


if __name__ == "__main__":
    sys.exit(main())
