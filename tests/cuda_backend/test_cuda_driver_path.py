"""The CUDA backend's one driver path: the hot-path interface ``aiogpu.cuda.driver.HotPath`` and
its two implementations, the C extension (``_CHot``) and cuda-bindings (``_BindingsHot``).

Both must make the same driver calls, in the same order, with the same arguments, and return
the same codes: checked call by call against recording entry points (the C side: ctypes
callbacks standing in for libcuda's, as in test_hotc.py; the cuda-bindings side: tests/fakes'
driver with recording functions), and for whole submissions of the backend (uploads, launches,
cross-lane waits, device copies, downloads, joins) under each completion mode. And no call site
outside the driver module tells the implementations apart.
"""
from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest

from backends import on_fake_cuda, run_on_fake_cuda

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "aiogpu"
IMPLEMENTATIONS = ("_CHot", "_BindingsHot", "_CtypesHot")

if os.environ.get("AIOGPU_REQUIRE_HOTC"):
    import aiogpu.cuda._hotc  # noqa: F401
else:
    pytest.importorskip("aiogpu.cuda._hotc", reason="the optional C extension is not built")


# -- no call site tells the implementations apart ---------------------------------------------------
def _implementation_uses(path: Path) -> list[str]:
    """Where ``path`` names a hot-path implementation class, or tests the type of the hot path
    (``type(hot)``, ``type(D.HOT)``, ``isinstance(x, ...Hot...)``): "line: text"."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        if name in IMPLEMENTATIONS:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            if node.func.id == "type" and "hot" in ast.unparse(node.args[0]).lower():
                found.append(f"{node.lineno}: {ast.unparse(node)}")
            if node.func.id == "isinstance" and len(node.args) == 2 and "hot" in ast.unparse(node.args[1]).lower():
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_call_site_tells_the_hot_path_implementations_apart():
    """Only the driver module (which defines and chooses them) and the bench (which times each)
    name an implementation; nothing tests the type of the hot path."""
    allowed = {PACKAGE / "cuda" / "driver.py", PACKAGE / "cli" / "bench_cuda.py"}
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        uses = _implementation_uses(path)
        if path in allowed:
            uses = [u for u in uses if "type(" in u or "isinstance(" in u]
        if uses:
            offenders[str(path.relative_to(ROOT))] = uses
    assert offenders == {}


def test_the_scan_finds_a_type_test(tmp_path):
    """(The check above would see the forms it looks for.)"""
    src = tmp_path / "m.py"
    src.write_text("def f(hot, D):\n    if type(hot) is D._CHot:\n        pass\n"
                   "    return isinstance(hot, D._BindingsHot)\n")
    assert len(_implementation_uses(src)) >= 2


# -- the interface, call by call --------------------------------------------------------------------
INTERFACE_SCRIPT = r"""
import json, sys
sys.path.insert(0, "tests/cuda_backend")
from cuda.bindings import driver as cu

# cuda-bindings' hot functions, recording: (name as the C entry points are named, *int args)
NAMES = {"cuLaunchKernel": "launch", "cuMemcpyAsync": "memcpy", "cuStreamWriteValue64": "write64",
         "cuStreamWaitValue64": "wait64", "cuStreamWaitEvent": "wait_event", "cuEventRecord": "record",
         "cuEventQuery": "query", "cuLaunchHostFunc": "host_func"}
calls, codes = [], {}
def recorder(short):
    def call(*args):
        calls.append((short, *(0 if a is None else int(a) for a in args)))
        return (codes.get(short, 0),)
    return call
for long, short in NAMES.items():
    setattr(cu, long, recorder(short))

import aiogpu.cuda.driver as D
from test_hotc import FakeDriver

S, W, E, F, P = 0x5000, 0x6000, 0x7000, 0x8000, 0x9000
CASES = [   # (name, codes, call)
    ("launch", {}, lambda h: h.launch(F, 1, 2, 3, 4, 5, 6, 64, S, P)),
    ("launch+word", {}, lambda h: h.launch(F, 1, 2, 3, 4, 5, 6, 0, S, P, W, 7)),
    ("launch fails: no word", {"launch": 719}, lambda h: h.launch(F, 1, 1, 1, 1, 1, 1, 0, S, P, W, 7)),
    ("word write fails", {"write64": 999}, lambda h: h.launch(F, 1, 1, 1, 1, 1, 1, 0, S, P, W, 7)),
    ("memcpy", {}, lambda h: h.memcpy(0x10, 0x20, 1 << 33, S)),
    ("memcpy+word", {}, lambda h: h.memcpy(0x10, 0x20, 100, S, W, 8)),
    ("memcpy fails: no word", {"memcpy": 1}, lambda h: h.memcpy(0x10, 0x20, 100, S, W, 8)),
    ("write64", {}, lambda h: h.write64(S, W, 11)),
    ("wait64", {}, lambda h: h.wait64(S, W, 5, 0)),
    ("wait_event", {}, lambda h: h.wait_event(S, E)),
    ("record", {}, lambda h: h.record(E, S)),
    ("query pending", {"query": 600}, lambda h: h.query(E)),
    ("host_func", {}, lambda h: h.host_func(S, 0x1234, 0x5678)),
]

def run(hot, log, set_codes):
    out = []
    for name, case_codes, call in CASES:
        log.clear()
        set_codes(case_codes)
        got = call(hot)
        out.append([name, int(got), type(got) is int or isinstance(got, int), [list(c) for c in log]])
    return out

bindings = run(D._BindingsHot(), calls, lambda c: (codes.clear(), codes.update(c)))
drv = FakeDriver()
def c_codes(c):
    drv.codes = dict.fromkeys(drv.codes, 0)
    drv.codes.update(c)
c = run(D._CHot(drv.addresses), drv.calls, c_codes)
print(json.dumps({"bindings": bindings, "c": c}))
"""

S, W, E, F, P = 0x5000, 0x6000, 0x7000, 0x8000, 0x9000
EXPECTED = {   # the calls each case makes, and its result
    "launch": (0, [["launch", F, 1, 2, 3, 4, 5, 6, 64, S, P, 0]]),
    "launch+word": (0, [["launch", F, 1, 2, 3, 4, 5, 6, 0, S, P, 0], ["write64", S, W, 7, 0]]),
    "launch fails: no word": (719, [["launch", F, 1, 1, 1, 1, 1, 1, 0, S, P, 0]]),
    "word write fails": (999, [["launch", F, 1, 1, 1, 1, 1, 1, 0, S, P, 0], ["write64", S, W, 7, 0]]),
    "memcpy": (0, [["memcpy", 0x10, 0x20, 1 << 33, S]]),
    "memcpy+word": (0, [["memcpy", 0x10, 0x20, 100, S], ["write64", S, W, 8, 0]]),
    "memcpy fails: no word": (1, [["memcpy", 0x10, 0x20, 100, S]]),
    "write64": (0, [["write64", S, W, 11, 0]]),
    "wait64": (0, [["wait64", S, W, 5, 0]]),
    "wait_event": (0, [["wait_event", S, E, 0]]),
    "record": (0, [["record", E, S]]),
    "query pending": (600, [["query", E]]),
    "host_func": (0, [["host_func", S, 0x1234, 0x5678]]),
}


@on_fake_cuda
def test_both_implementations_make_the_same_calls_and_return_the_same_codes():
    """Each interface method on each implementation: the driver calls it makes (the completion
    word written after a launch or copy only if that was queued), and the code it returns, an
    int."""
    proc = run_on_fake_cuda(INTERFACE_SCRIPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for impl in ("bindings", "c"):
        table = {name: (code, calls) for name, code, is_int, calls in got[impl]}
        assert table == EXPECTED, impl
        assert all(is_int for _, _, is_int, _ in got[impl]), impl


# -- whole submissions of the backend --------------------------------------------------------------
SUBMISSION_SCRIPT = r"""
import ctypes, json, os, sys, threading
sys.path.insert(0, "tests/cuda_backend")
import numpy as np
from cuda.bindings import driver as cu

IMPL, CONFIG = os.environ["TEST_HOT"], json.loads(os.environ["TEST_CONFIG"])
MAIN = threading.get_ident()
log, held, released = [], [], [True]

def note(name, args):
    if threading.get_ident() == MAIN:       # (not the waiter's completion-side calls)
        log.append((name, *(0 if a is None else int(a) for a in args)))

# The device "runs" nothing until released: word writes are held, queries say NOT_READY; so
# every dependency is pending when the next operation is submitted.
def write(stream, word, value, flags):
    if released[0]:
        ctypes.c_uint64.from_address(int(word)).value = value
    else:
        held.append((int(word), value))
    return 0
def query(*a):
    return 0 if released[0] else 600
EFFECTS = {"launch": lambda *a: 0, "memcpy": lambda d, s, n, st: ctypes.memmove(int(d), int(s), n) and 0,
           "write64": write, "wait64": lambda *a: 0, "wait_event": lambda *a: 0, "record": lambda *a: 0,
           "query": query, "host_func": lambda s, fn, d: HOSTFN(int(fn))(int(d)) or 0}
HOSTFN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
NAMES = {"cuLaunchKernel": "launch", "cuMemcpyAsync": "memcpy", "cuStreamWriteValue64": "write64",
         "cuStreamWaitValue64": "wait64", "cuStreamWaitEvent": "wait_event", "cuEventRecord": "record",
         "cuEventQuery": "query", "cuLaunchHostFunc": "host_func"}

def bindings_entry(short, prefix=""):
    effect = EFFECTS[short]
    def call(*args):
        note(prefix + short, args[:-1] if short == "launch" else args)   # (cuLaunchKernel's extra)
        return (effect(*args[:4]) if short == "memcpy" else effect(*args),)
    return call

for long, short in NAMES.items():           # what the cuda-bindings implementation binds
    setattr(cu, long, bindings_entry(short))
cu.cuStreamQuery = lambda s: (0 if released[0] else 600,)

import aiogpu
import aiogpu.cuda.driver as D
if IMPL == "c":
    from test_hotc import PROTOS
    def c_entry(short):
        effect = EFFECTS[short]
        def call(*args):
            note(short, args[:-1] if short == "launch" else args)   # (extra, NULL)
            return effect(*args)
        return PROTOS[short](call)
    keep = {short: c_entry(short) for short in NAMES.values()}
    D.HOT = D._CHot({k: ctypes.cast(f, ctypes.c_void_p).value for k, f in keep.items()})
    for long, short in NAMES.items():       # a cuda-bindings call now is a bypass of the hot path
        setattr(cu, long, bindings_entry(short, prefix="cuda-bindings "))
else:
    assert D.HOT.name == "cuda-bindings"

rt = aiogpu.Runtime("cuda", **CONFIG)
d0 = rt.devices[0]
import aiogpu.cuda.encode as E                # (compiled, the C path's lanes call the driver themselves)
assert {lane.direct for lane in d0.lanes} == {IMPL == "c" and E.__file__.endswith(".so")}
k2 = aiogpu.kernel("f32*, const f32*, u32", cuda='extern "C" __global__ void k2(float* a, const float* b, unsigned n) {}',
                   name="k2")(lambda launch, a, b, n: None)
x, y = d0.alloc(1024), d0.alloc(1024)
host, out = np.arange(256, dtype=np.float32), np.empty(256, np.float32)
assert d0.launch(k2, (256,), (256,), (x, y, 0)).wait(30)     # (compiled and loaded now, not deferred)
released[0] = False
log.clear()
futs = [aiogpu.copy(x, host)]                                 # upload (h2d lane)
futs.append(d0.launch(k2, (256,), (256,), (y, x, 256)))       # waits for the upload's lane
futs.append(d0.launch(k2, (256,), (256,), (x, y, 256)))       # same lane as the first launch
futs.append(aiogpu.copy(y, x))                                # device copy after the launches
futs.append(aiogpu.copy(out, y))                              # download after the device copy
futs.append(aiogpu.gather(*futs))                             # a join
submitted = list(log)
released[0] = True
for word, value in held:
    ctypes.c_uint64.from_address(word).value = value
for f in futs:
    assert f.wait(30) and f.exception() is None, f
assert (out == host).all()
x.free(); y.free()
names = {}
for lane in (l for d in rt.devices for l in d.lanes):
    names[lane.sh] = lane.name
    if lane.wordp:
        names[lane.wordp] = "word " + lane.name
def norm(v):
    return names.get(v, "address" if v > 1 << 32 else v)
print(json.dumps({"hot": D.HOT.name, "calls": [[c[0], *map(norm, c[1:])] for c in submitted],
                  "leaks": rt.leaks(5)}))
rt.close()
"""

CONFIGS = {"words": {}, "event_waits": {"event_waits": True}, "events": {"completion_words": False}}


def _submissions(impl: str, config: dict) -> dict:
    proc = run_on_fake_cuda(SUBMISSION_SCRIPT, TEST_HOT=impl, TEST_CONFIG=json.dumps(config))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@on_fake_cuda
@pytest.mark.parametrize("mode", sorted(CONFIGS))
def test_both_implementations_submit_the_same_driver_calls(mode):
    """The backend's submissions on either implementation: the same driver calls in the same
    order (cross-lane waits, the work, the completion-word write or event record), and no
    cuda-bindings hot call on the C path. Then the mode's completion rule itself: with words
    and no events, each copy is followed at once by its lane's word write, and a launch may
    leave the write to a later one on its lane (``Lane.lazy``; these two launches both do),
    which comes before anything waits for the word; with ``event_waits``, an event record
    comes between the work and the word; without words, events only."""
    got = {impl: _submissions(impl, CONFIGS[mode]) for impl in ("bindings", "c")}
    assert got["bindings"]["hot"] == "cuda-bindings" and got["c"]["hot"] == "c"
    assert got["bindings"]["leaks"] == {} and got["c"]["leaks"] == {}
    calls = got["bindings"]["calls"]
    assert got["c"]["calls"] == calls
    assert not any(c[0].startswith("cuda-bindings") for c in got["c"]["calls"])
    kinds = [c[0] for c in calls]
    assert kinds.count("launch") == 2 and kinds.count("memcpy") == 3, kinds
    work = [i for i, k in enumerate(kinds) if k in ("launch", "memcpy")]
    if mode == "words":
        assert "record" not in kinds and "wait64" in kinds, kinds
        left = 0
        for i in work:
            stream = calls[i][-1] if kinds[i] == "memcpy" else calls[i][9]
            write = ["write64", stream, "word " + stream]
            if kinds[i] == "memcpy" or calls[i + 1][:3] == write:
                assert calls[i + 1][:3] == write, calls[i:i + 2]
                continue
            left += 1                  # (a launch that left its word to a later write)
            later = [c for c in calls[i + 1:] if c[:3] == write or c[0] == "wait64" and c[2] == write[2]]
            assert later and later[0][:3] == write, (calls[i], later)
        assert left == 2, calls
    elif mode == "event_waits":
        assert "wait64" not in kinds and "wait_event" in kinds, kinds
        for i in work:
            assert kinds[i + 1:i + 3] == ["record", "write64"], calls[i:i + 3]
    else:
        assert "write64" not in kinds and "wait64" not in kinds and "wait_event" in kinds, kinds
        for i in work:
            assert kinds[i + 1] == "record", calls[i:i + 2]


# -- the choice ------------------------------------------------------------------------------------
CHOICE_SCRIPT = r"""
import aiogpu.cuda.driver as D
print(D.HOT.name, "|", D.HOT_REASON)
"""


@on_fake_cuda
@pytest.mark.parametrize(("env", "reason"), [
    ("bindings", "AIOGPU_CUDA_HOT=bindings"),
    ("", "the C hot path is unavailable"),                     # (the fake is not libcuda)
    ("ctypes", "AIOGPU_CUDA_HOT=ctypes names no hot path (c, bindings)"),
])
def test_the_choice_and_its_reason(env, reason):
    """Where the C path cannot run, cuda-bindings, and ``HOT_REASON`` says why; a value of
    ``AIOGPU_CUDA_HOT`` that names no implementation is reported there, not ignored."""
    proc = run_on_fake_cuda(CHOICE_SCRIPT, AIOGPU_CUDA_HOT=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    name, why = proc.stdout.strip().split(" | ", 1)
    assert name == "cuda-bindings" and reason in why, proc.stdout
