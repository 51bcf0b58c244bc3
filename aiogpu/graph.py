"""Graphs: capture launches, copies and joins once; replay them many times.

    with aiogpu.Graph() as g:            # record, do not run
        a = d0.launch(k, grid, block, args)
        b = aiogpu.copy(z, y, after=[a])
    exe = g.instantiate()                # once: per-queue packet lists, kernargs in graph memory
    await exe.launch()                   # one GPUFuture for the whole replay
    await exe.launch(args={a: new_args}) # this replay only, with patched kernel arguments
    exe.close()                          # (or `with g.instantiate() as exe:`) memory back once replays retired

Edges are the ``after=`` lists plus the buffer hazards between captured operations. This module
owns the capture (``Graph``; the nodes it returns, ``GraphNode``, are places in it, not
futures: see capture.py) and the executor base (``GraphExec``: the replay front,
patch validation, what a replay reads and writes); each backend's executor builds and replays
(HSA: prebuilt AQL packet lists, ``aiogpu/hsa/graph.py``; CUDA: a CUDA graph,
``aiogpu/cuda/graphs.py``). Replays of one executable run in launch order.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from . import capture as _capture
from ._core import hazards
from ._core import submit as _submit
from .backend import GraphExecHooks
from .device import MAX_GRID, MAX_WORKGROUP, Device, check_args, check_dims
from .capture import GraphNode
from .futures import GPUFuture
from .kernels import Kernel
from .memory import Buffer


class Graph:
    """Records operations of one runtime instead of running them (``with Graph() as g:``).

    The capture belongs to the block: to the task (or thread) that entered it. Tasks and threads
    started inside it run their operations, as they would outside."""

    def __init__(self) -> None:
        self.nodes: list[GraphNode] = []
        self.runtime: Any = None
        self._host = hazards.Hazards()        # buffers and host arrays: by address range
        self._token: Any = None

    def __enter__(self) -> "Graph":
        self._token = _capture.begin(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _capture.end(self._token)

    def accepts(self, runtime: Any) -> bool:
        """Whether this capture records ``runtime``'s operations (a graph holds one runtime's)."""
        if self.runtime is None:
            self.runtime = runtime
        if self.runtime is not runtime:
            raise ValueError("a graph captures the operations of one runtime")
        return True

    # -- recording (called by Device.launch, Runtime.copy, Runtime.gather) -----------------------
    def _state(self, key: Any) -> Any:
        """The capture's ordering state of a Buffer or view (its bytes, by address: device
        addresses are unique in the process, so views of one buffer conflict where they
        overlap) or of a host array."""
        if isinstance(key, Buffer):
            return self._host.host(key.address, key.nbytes)
        return self._host.host(key[1], key[2])

    def _add(self, kind: str, op: dict, after: list, reads: list, writes: list, label: str) -> GraphNode:
        for f in after:
            if not isinstance(f, GraphNode) or f.graph is not self:
                raise ValueError(f"inside a capture, after= takes nodes of the same graph, got {f!r}")
        rstates, wstates = [self._state(k) for k in reads], [self._state(k) for k in writes]
        deps = hazards.dependencies(rstates, wstates, after)   # the run-time rules, at capture
        node = GraphNode(self, kind, op, deps, len(self.nodes), label)
        hazards.record(node, rstates, wstates)
        self.nodes.append(node)
        return node

    def record_launch(self, device: Device, kernel: Kernel, grid: tuple, block: tuple, args: tuple,
                      after: list) -> GraphNode:
        """A launch node (arguments already checked by ``Device.launch``)."""
        buffers = {i: a for i, a in enumerate(args) if isinstance(a, Buffer)}
        reads = [buffers[i] for i in kernel.reads if i in buffers]
        writes = [buffers[i] for i in kernel.writes if i in buffers]
        op = dict(device=device, kernel=kernel, grid=grid, block=block, args=args)
        return self._add("launch", op, after, reads, writes, f"{kernel.name}@{device.name}")

    def record_copy(self, dst: Any, src: Any, after: list) -> GraphNode:
        """A copy node (sides already checked by ``aiogpu.copy``)."""
        key = lambda s: s if isinstance(s, Buffer) else ("host", s.__array_interface__["data"][0], s.nbytes)  # noqa: E731
        op = dict(dst=dst, src=src)
        return self._add("copy", op, after, [key(src)], [key(dst)], "copy")

    def record_gather(self, futures: list) -> GraphNode:
        """A join node: later nodes that name it wait for all of ``futures``."""
        return self._add("gather", {}, futures, [], [], "gather")

    def instantiate(self) -> "GraphExec":
        """Build the graph's executable once (HSA: per-queue packet lists; CUDA: a CUDA graph);
        launch the result any number of times. ValueError for an empty graph."""
        if not self.nodes:
            raise ValueError("an empty graph cannot be instantiated")
        return self.runtime.instantiate(self)


class GraphExec(GraphExecHooks):
    """An instantiated graph. ``launch()`` replays it and returns one GPUFuture.

    What it holds on the device (HSA: kernarg memory and host-memory locks; CUDA: the CUDA
    graph and its executable) is given back once it is closed (``close()``, or the end of
    ``with graph.instantiate() as exe:``) or collected, and its last replay has retired: never
    while a replay may still read it. Otherwise at ``Runtime.close``.

    A backend's executable implements the hooks of ``aiogpu/backend.py``'s ``GraphExecHooks``."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.runtime = graph.runtime
        self.nodes = list(graph.nodes)
        self.replays = 0
        self.closed = False
        self._live = 0            # replays launched and not yet retired
        self._unpatched: tuple[list, list, list] | None = None   # see _unpatched_buffers

    def close(self) -> None:
        """Give back what the executable holds once its launched replays have retired (they
        run on, and complete, as launched). Later ``launch`` calls raise ValueError.
        Idempotent; never blocks."""
        rt = self.runtime
        with rt.lock:
            if self.closed:
                return
            self.closed = True
            if self._live == 0 and not rt.closed:
                self._release()

    def __enter__(self) -> "GraphExec":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _replay_retired(self) -> None:
        """One launched replay retired (under the lock): the last one of a closed executable
        releases it."""
        self._live -= 1
        if self._live == 0 and self.closed and not self.runtime.closed:
            self._release()

    def launch(self, args: Mapping[GraphNode, tuple] | None = None, *,
               grid: Mapping[GraphNode, Any] | None = None,
               block: Mapping[GraphNode, Any] | None = None) -> GPUFuture[None]:
        """Replay the graph; returns one GPUFuture that completes when every node has.

        ``args``/``grid``/``block`` patch launch nodes for this replay only. They are checked
        (signature, devices, dimensions) before anything is submitted (TypeError/ValueError).
        ValueError once the executable is closed; RuntimeClosedError once the runtime is.
        """
        rt = self.runtime
        patches = self._check_patches(args or {}, grid or {}, block or {})
        with rt.lock:
            rt._check_open()
            if self.closed:
                raise ValueError("this graph executable is closed")
            reads, writes, keep = self._buffers(patches) if patches else self._unpatched_buffers()
            label = f"graph replay {self.replays} ({len(self.nodes)} nodes)"
            fut = _submit.guarded(rt, self.home_device(), label, reads, writes, [], lambda deps: _submit.replay(
                rt, self, patches, deps, reads, writes, keep, label))
            self.replays += 1
            if not fut.retired:   # (a replay failed at once for a failed input ran nothing)
                self._live += 1
                fut._on_retired(self._replay_retired)
            return fut

    def _check_patches(self, args: Mapping, grid: Mapping, block: Mapping) -> dict:
        out: dict[GraphNode, dict] = {}
        for name, table in (("args", args), ("grid", grid), ("block", block)):
            if not isinstance(table, Mapping):
                raise TypeError(f"{name}= takes a dict of graph node -> value")
            for node, value in table.items():
                if not isinstance(node, GraphNode) or node.graph is not self.graph:
                    raise ValueError(f"{name}= key {node!r} is not a node of this graph")
                if node.kind != "launch":
                    raise ValueError(f"{name}= patches launch nodes only; {node.label} is a {node.kind}")
                out.setdefault(node, {})[name] = value
        for node, p in out.items():
            device = node.op["device"]
            new_args = p.get("args", node.op["args"])
            values, lengths, buffers = check_args(device, node.op["kernel"], new_args)
            if any(not isinstance(b, Buffer) for b in buffers.values()):
                raise TypeError(f"args= patches of {node.label} take Buffers only (graphs do not take "
                                f"other libraries' arrays)")
            g = check_dims("grid", p.get("grid", node.op["grid"]), MAX_GRID)
            b = check_dims("block", p.get("block", node.op["block"]), MAX_WORKGROUP)
            if len(g) != len(b) or int(np.prod(b)) > MAX_WORKGROUP:
                raise ValueError(f"patched grid {g} / block {b} of {node.label} are inconsistent")
            device._check_grid(g, b)
            p.update(values=values, lengths=lengths, buffers=buffers, grid=g, block=b, args=new_args)
        return out

    def _unpatched_buffers(self) -> tuple[list, list, list]:
        """``_buffers({})``, computed once: the nodes and their arguments never change, so an
        unpatched replay only re-checks that its buffers are still allocated."""
        cached = self._unpatched
        if cached is None:
            cached = self._unpatched = self._buffers({})
        else:
            for state in cached[0] + cached[1]:
                if isinstance(state, Buffer):
                    state._check_usable()
        return cached

    def _buffers(self, patches: dict) -> tuple[list, list, list]:
        """Ordering states read and written by this replay, and what it keeps alive."""
        rt = self.runtime
        reads: list = []
        writes: list = []
        keep: list = []
        for node in self.nodes:
            if node.kind == "launch":
                args = patches.get(node, {}).get("args", node.op["args"])
                kernel = node.op["kernel"]
                kreads, kwrites = kernel.reads, kernel.writes
                for i, a in enumerate(args):
                    if isinstance(a, Buffer):
                        a._check_usable()
                        # As an ordinary launch: a ``T*`` is read and written (a failed earlier
                        # writer fails the replay), an ``out T*`` only written.
                        if i in kreads:
                            reads.append(a)
                        if i in kwrites:
                            writes.append(a)
            elif node.kind in ("copy", "shader-copy"):
                for side, bucket in (("src", reads), ("dst", writes)):
                    s = node.op[side]
                    if isinstance(s, Buffer):
                        s._check_usable()
                        bucket.append(s)
                    else:
                        bucket.append(rt.hazards.host(s.__array_interface__["data"][0], s.nbytes))
                        keep.append(s)
        uniq = lambda xs: list({id(x): x for x in xs}.values())  # noqa: E731
        return uniq(reads), uniq(writes), keep

    def copy_device(self, node: GraphNode) -> Device:
        """The device whose engine runs a copy node (the copy-direction rule)."""
        src, dst = node.op["src"], node.op["dst"]
        return src.device if isinstance(src, Buffer) else dst.device
