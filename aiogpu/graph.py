"""Graphs: capture launches, copies and joins once; replay them as prebuilt packet lists.

    with aiogpu.Graph() as g:            # record, do not run
        a = d0.launch(k, grid, block, args)
        b = aiogpu.copy(z, y, after=[a])
    exe = g.instantiate()                # once: per-queue packet lists, kernargs in graph memory
    await exe.launch()                   # one GPUFuture for the whole replay
    await exe.launch(args={a: new_args}) # this replay only, with patched kernel arguments

Edges are the ``after=`` lists plus the buffer hazards between captured operations. A replay
publishes each queue's list (every body, then every header in order), issues SDMA copies with
their dependency signals, and joins the queues' tails with a barrier-AND whose signal is the
replay's future. Replays of one executable run in launch order; every replay takes fresh
signals, so none can reset a signal an earlier replay may still read.
"""
from __future__ import annotations

import ctypes
import itertools
import struct
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from . import capture as _capture
from . import ordering
from .device import MAX_GRID, MAX_WORKGROUP, Device, check_dims, pack_args
from .hsa_bindings import packets as P
from .kernels import Kernel, copy_kernel
from .memory import Buffer
from .queues import PacketGroup, barrier_and_packets
from .futures import GPUFuture

COMPLETION_OFFSET = P.hsa_kernel_dispatch_packet_t.completion_signal.offset
DEP_OFFSET = P.hsa_barrier_and_packet_t.dep_signal.offset
GRID_OFFSET = P.hsa_kernel_dispatch_packet_t.workgroup_size_x.offset


class GraphNode(GPUFuture):
    """A captured operation: usable in ``after=`` inside the capture and as a patch key."""

    __slots__ = ("graph", "kind", "op", "deps", "index")

    def __init__(self, graph: "Graph", kind: str, op: dict, deps: dict, index: int, label: str):
        super().__init__(None, label)
        self.graph, self.kind, self.op, self.deps, self.index = graph, kind, op, deps, index
        self.retired = False

    def __await__(self):
        raise RuntimeError("a graph node is not awaitable; instantiate the graph and launch it")
        yield  # pragma: no cover

    def done(self) -> bool:
        return False


class _NodeState:
    """Per-buffer ordering state inside a capture (``ordering`` applies the run-time rules)."""

    __slots__ = ("last_write", "reads")

    def __init__(self):
        self.last_write, self.reads = None, []


class Graph:
    """Records operations of one runtime instead of running them (``with Graph() as g:``)."""

    def __init__(self) -> None:
        self.nodes: list[GraphNode] = []
        self.runtime: Any = None
        self._states: dict[Any, _NodeState] = {}
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
    def _state(self, key: Any) -> _NodeState:
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = _NodeState()
        return state

    def _add(self, kind: str, op: dict, after: list, reads: list, writes: list, label: str) -> GraphNode:
        for f in after:
            if not isinstance(f, GraphNode) or f.graph is not self:
                raise ValueError(f"inside a capture, after= takes nodes of the same graph, got {f!r}")
        rstates, wstates = [self._state(k) for k in reads], [self._state(k) for k in writes]
        deps = ordering.dependencies(rstates, wstates, after)   # the run-time rules, at capture
        node = GraphNode(self, kind, op, deps, len(self.nodes), label)
        ordering.record(node, rstates, wstates)
        self.nodes.append(node)
        return node

    def record_launch(self, device: Device, kernel: Kernel, grid: tuple, block: tuple, args: tuple,
                      after: list) -> GraphNode:
        """A launch node (arguments already checked by ``Device.launch``)."""
        buffers = {i: a for i, a in enumerate(args) if isinstance(a, Buffer)}
        reads = list(buffers.values())
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

    def instantiate(self) -> Any:
        """Build the graph's executable once (HSA: per-queue packet lists; CUDA: a CUDA graph);
        launch the result any number of times."""
        if not self.nodes:
            raise ValueError("an empty graph cannot be instantiated")
        custom = getattr(self.runtime, "instantiate_graph", None)
        return custom(self) if custom is not None else GraphExec(self)


@dataclass
class _Lane:
    """One compute queue's share of a graph: prebuilt packets and where to patch them."""

    queue: Any
    device: Device
    blob: bytearray = field(default_factory=bytearray)
    headers: list = field(default_factory=list)
    completions: list = field(default_factory=list)   # (packet index, node) completed there
    waits: list = field(default_factory=list)         # (packet index, slot, node) waited on
    dispatch_at: dict = field(default_factory=dict)   # node -> packet index of its dispatch

    def add(self, pkt: Any, header: int) -> int:
        self.blob += bytes(pkt)
        self.headers.append(header)
        return len(self.headers) - 1


class GraphExec:
    """An instantiated graph. ``launch()`` replays it and returns one GPUFuture."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.runtime = rt = graph.runtime
        self.nodes = list(graph.nodes)
        self.replays = 0
        self._last: GPUFuture | None = None
        with rt.lock:
            rt.check_open()
            self._prepare_host_memory()
            self._plan_lanes()
            self._build()

    # -- instantiation ---------------------------------------------------------------------------
    def _prepare_host_memory(self) -> None:
        """Host arrays that copies read or write stay locked for the executable's life."""
        rt, pins = self.runtime, []
        for node in self.nodes:
            if node.kind == "copy":
                for side in ("dst", "src"):
                    arr = node.op[side]
                    if isinstance(arr, np.ndarray):
                        addr = arr.__array_interface__["data"][0]
                        node.op[side + "_ptr"] = rt.host.lock(addr, arr.nbytes, arr)
                        pins.append((addr, arr.nbytes))
        self._host_pins = pins
        weakref.finalize(self, _unlock_all, rt, pins)

    def _copy_device(self, node: GraphNode) -> Device:
        src, dst = node.op["src"], node.op["dst"]
        return src.device if isinstance(src, Buffer) else dst.device

    def _plan_lanes(self) -> None:
        """Each node gets a lane: a compute queue (launches, gathers, shader copies) or an SDMA
        engine (copies while one is free at instantiation)."""
        self.lane_of: dict[GraphNode, Any] = {}
        self.engine_of: dict[GraphNode, int] = {}
        rr = itertools.count()
        for node in self.nodes:
            if node.kind == "copy":
                dev = self._copy_device(node)
                src_agent, dst_agent = self._copy_agents(node)
                engine = dev.engines.pick(dst_agent, src_agent)
                if engine is not None:
                    self.engine_of[node] = engine
                    self.lane_of[node] = ("sdma", dev)
                    continue
                node.kind = "shader-copy"
            dev = self._node_device(node)
            same = [self.lane_of[d] for d in node.deps
                    if isinstance(self.lane_of[d], _QueueRef) and self.lane_of[d].device is dev]
            queue = same[-1].queue if same else dev.queues[next(rr) % len(dev.queues)]
            self.lane_of[node] = _QueueRef(dev, queue)

    def _node_device(self, node: GraphNode) -> Device:
        if node.kind == "launch":
            return node.op["device"]
        if node.kind == "shader-copy":
            return self._copy_device(node)
        devs = [self._node_device(d) if not isinstance(self.lane_of.get(d), tuple) else self.lane_of[d][1]
                for d in node.deps]
        return devs[0] if devs else self.runtime.devices[0]

    def _copy_agents(self, node: GraphNode) -> tuple[Any, Any]:
        cpu = self.runtime._cpu
        side = lambda s: s.device.agent if isinstance(s, Buffer) else cpu  # noqa: E731
        return side(node.op["src"]), side(node.op["dst"])

    def _build(self) -> None:
        """Prebuilt packets per lane; kernargs of every launch in graph-owned memory."""
        self.lanes: dict[str, _Lane] = {}
        self.signaled: set[GraphNode] = {n for n in self.nodes if n in self.engine_of}
        for node in self.nodes:
            for dep in node.deps:
                if self._lane_key(dep) != self._lane_key(node) or node in self.engine_of:
                    self.signaled.add(dep)
        self._kernarg_blocks = []
        for node in self.nodes:
            if node in self.engine_of:
                continue
            ref = self.lane_of[node]
            lane = self.lanes.get(ref.queue.name)
            if lane is None:
                lane = self.lanes[ref.queue.name] = _Lane(ref.queue, ref.device)
            self._emit(lane, node)

    def _lane_key(self, node: GraphNode) -> Any:
        ref = self.lane_of[node]
        return ("sdma", id(node)) if isinstance(ref, tuple) else ref.queue.name

    def _emit(self, lane: _Lane, node: GraphNode) -> None:
        same = any(self._lane_key(d) == lane.queue.name for d in node.deps)
        cross = [d for d in node.deps if self._lane_key(d) != lane.queue.name]
        barrier = same
        if cross:
            for j, (pkt, header) in enumerate(barrier_and_packets([0] * len(cross), barrier=barrier)):
                i = lane.add(pkt, header)
                for slot, dep in enumerate(cross[j * P.BARRIER_MAX_DEPS:(j + 1) * P.BARRIER_MAX_DEPS]):
                    lane.waits.append((i, slot, dep))
            barrier = False
        if node.kind == "gather":
            pkt, header = barrier_and_packets([], barrier=barrier)[0]
            i = lane.add(pkt, header)
        else:
            pkt, word = self._dispatch_packet(lane.device, node, barrier)
            i = lane.add(pkt, word)
            lane.dispatch_at[node] = i
        if node in self.signaled:
            lane.completions.append((i, node))

    def _dispatch_packet(self, device: Device, node: GraphNode, barrier: bool) -> tuple[Any, int]:
        kernel, grid, block, values, lengths = self._dispatch_args(device, node, node.op.get("args"))
        loaded = device.loaded(kernel)
        data = pack_args(loaded, values, lengths, grid, block)
        address = self._graph_kernarg(device, data, loaded.kernarg_align)
        pkt = P.hsa_kernel_dispatch_packet_t()
        dims = len(grid)
        pkt.workgroup_size_x, pkt.workgroup_size_y, pkt.workgroup_size_z = tuple(block) + (1,) * (3 - dims)
        pkt.grid_size_x, pkt.grid_size_y, pkt.grid_size_z = tuple(grid) + (1,) * (3 - dims)
        pkt.private_segment_size = loaded.private_segment_size
        pkt.group_segment_size = loaded.group_segment_size
        pkt.kernel_object = loaded.kernel_object
        pkt.kernarg_address = address
        header = P.make_header(P.HSA_PACKET_TYPE_KERNEL_DISPATCH, barrier=barrier)
        return pkt, header | dims << 16

    def _dispatch_args(self, device: Device, node: GraphNode, args: Any) -> tuple:
        if node.kind == "launch":
            kernel = node.op["kernel"]
            values, lengths, _ = device._check_args(kernel, args)
            return kernel, node.op["grid"], node.op["block"], values, lengths
        src, dst = node.op["src"], node.op["dst"]
        n = dst.nbytes
        ptr = lambda s, side: s.address if isinstance(s, Buffer) else node.op[side + "_ptr"]  # noqa: E731
        return copy_kernel, (max(n, 1),), (256,), [ptr(dst, "dst"), ptr(src, "src"), n], [n, n]

    def _graph_kernarg(self, device: Device, data: bytes, align: int = 64) -> int:
        """Graph-owned kernarg memory for ``data``, aligned to ``align`` (the kernel's
        kernarg_segment_align, at least 64)."""
        align = max(align, 64)
        if self._kernarg_blocks:   # skip to the alignment inside the current block
            pad = -self._kernarg_next % align
            self._kernarg_next += pad
            self._kernarg_room -= pad
        address, size = self.runtime.kernarg_block(device.agent) if not self._kernarg_blocks or \
            self._kernarg_room < len(data) else (None, None)
        if address is not None:
            self._kernarg_blocks.append(address)
            self._kernarg_next, self._kernarg_room = address, size
        address = self._kernarg_next
        ctypes.memmove(address, data, len(data))
        step = (len(data) + 63) // 64 * 64
        self._kernarg_next += step
        self._kernarg_room -= step
        return address

    # -- replay ----------------------------------------------------------------------------------
    def launch(self, args: Mapping[GraphNode, tuple] | None = None, *,
               grid: Mapping[GraphNode, Any] | None = None,
               block: Mapping[GraphNode, Any] | None = None) -> GPUFuture:
        """Replay the graph; returns one GPUFuture that completes when every node has.

        ``args``/``grid``/``block`` patch launch nodes for this replay only. They are checked
        (signature, devices, dimensions) before anything is submitted.
        """
        rt = self.runtime
        patches = self._check_patches(args or {}, grid or {}, block or {})
        with rt.lock:
            rt.check_open()
            return self._replay(patches)

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
            values, lengths, buffers = device._check_args(node.op["kernel"], new_args)
            g = check_dims("grid", p.get("grid", node.op["grid"]), MAX_GRID)
            b = check_dims("block", p.get("block", node.op["block"]), MAX_WORKGROUP)
            if len(g) != len(b) or int(np.prod(b)) > MAX_WORKGROUP:
                raise ValueError(f"patched grid {g} / block {b} of {node.label} are inconsistent")
            p.update(values=values, lengths=lengths, buffers=buffers, grid=g, block=b, args=new_args)
        return out

    def _buffers(self, patches: dict) -> tuple[list, list, list]:
        """Ordering states read and written by this replay, and what it keeps alive."""
        rt, reads, writes, keep = self.runtime, [], [], []
        for node in self.nodes:
            if node.kind == "launch":
                args = patches.get(node, {}).get("args", node.op["args"])
                kernel = node.op["kernel"]
                for i, a in enumerate(args):
                    if isinstance(a, Buffer):
                        a.check_usable()
                        (writes if i in kernel.writes else reads).append(a)
            elif node.kind in ("copy", "shader-copy"):
                for side, bucket in (("src", reads), ("dst", writes)):
                    s = node.op[side]
                    if isinstance(s, Buffer):
                        s.check_usable()
                        bucket.append(s)
                    else:
                        bucket.append(rt.hazards.host(s.__array_interface__["data"][0], s.nbytes))
                        keep.append(s)
        uniq = lambda xs: list({id(x): x for x in xs}.values())  # noqa: E731
        return uniq(reads), uniq(writes), keep

    def _replay(self, patches: dict) -> GPUFuture:
        hub = self.runtime.hub
        label = f"graph replay {self.replays} ({len(self.nodes)} nodes)"
        reads, writes, keep = self._buffers(patches)
        deps = ordering.dependencies(reads, writes, [])
        if self._last is not None and not self._last.retired:
            deps.setdefault(self._last, False)       # replays run in launch order
        err = ordering.failed_dependency(deps)
        if err is not None:
            return ordering.failed_without_running(hub, label, err, writes)
        head = [d for d in deps if not d.retired]
        node_futs = {n: hub.new_future(f"{n.label} (replay {self.replays})") for n in self.signaled}
        parts = []
        for lane in self.lanes.values():
            parts.append(self._submit_lane(lane, node_futs, head, deps, patches))
        for node, engine in self.engine_of.items():
            parts.append(self._submit_sdma(node, engine, node_futs, head, deps))
        replay = hub.new_future(label)
        replay.kind = "graph"
        first_dev = next(iter(self.lanes.values())).device if self.lanes else self.runtime.devices[0]
        replay.device = first_dev
        for part in parts:
            hub.depend(replay, part)
        packets = barrier_and_packets([p.signal for p in parts], replay.signal)
        # The replay's own future may retire (fail with its queue) before its parts stop running:
        # they are its predecessors, so later writers of its memory then wait for them.
        first_dev._track(replay, first_dev.queues[0], reads, writes, keep + [self],
                         head + parts + list(node_futs.values()))
        first_dev.queues[0].submit(PacketGroup([p for p, _ in packets], [h for _, h in packets], replay))
        self._last = replay
        self.replays += 1
        return replay

    def _submit_lane(self, lane: _Lane, node_futs: dict, head: list, deps: dict, patches: dict) -> GPUFuture:
        hub = self.runtime.hub
        blob = bytearray(lane.blob)
        for i, node in lane.completions:
            struct.pack_into("<Q", blob, i * 64 + COMPLETION_OFFSET, node_futs[node].signal)
        kernargs, align = {}, 16
        for node, p in patches.items():
            i = lane.dispatch_at.get(node)
            if i is None:
                continue
            loaded = lane.device.loaded(node.op["kernel"])
            kernargs[i] = pack_args(loaded, p["values"], p["lengths"], p["grid"], p["block"])
            align = max(align, loaded.kernarg_align)
            g3 = tuple(p["grid"]) + (1,) * (3 - len(p["grid"]))
            b3 = tuple(p["block"]) + (1,) * (3 - len(p["block"]))
            struct.pack_into("<HHHHIII", blob, i * 64 + GRID_OFFSET, *b3, 0, *g3)
        headers = list(lane.headers)
        for node, p in patches.items():
            i = lane.dispatch_at.get(node)
            if i is not None:
                headers[i] = (headers[i] & 0xFFFF) | len(p["grid"]) << 16
        segment = hub.new_future(f"graph lane {lane.queue.name} (replay {self.replays})")
        segment.device, segment.kind = lane.device, "graph"
        waits = []
        for i, slot, dep in lane.waits:
            fut = node_futs[dep]
            struct.pack_into("<Q", blob, i * 64 + DEP_OFFSET + 8 * slot, fut.signal)
            waits.append(fut)
        for fut in waits:
            hub.depend(segment, fut)
        for d in head:
            hub.depend(segment, d, semantic=deps[d])
        pre = barrier_and_packets([d.signal for d in head]) if head else []
        tail, tail_header = barrier_and_packets([], segment.signal, barrier=True)[0]
        blob = bytearray(b"".join(bytes(p) for p, _ in pre)) + blob + bytearray(bytes(tail))
        headers = [h for _, h in pre] + headers + [tail_header]
        offset = len(pre)
        marks = [(node_futs[n], offset + i) for i, n in lane.completions]
        kernargs = {offset + i: data for i, data in kernargs.items()}
        for fut, _ in marks:
            fut.device, fut.kind = lane.device, "dispatch"
            fut.preds.extend(head + waits)     # a node is ordered after the lane's waits
        lane.device._track(segment, lane.queue, [], [], [], head + waits)
        lane.queue.submit(PacketGroup([], headers, segment, blob=blob, marks=marks, kernargs=kernargs,
                                      kernarg_align=align))
        for fut, _ in marks:      # node futures retire with their lane
            fut._cleanup.append(lambda q=lane.queue, f=fut: q.inflight.pop(f, None))
        return segment

    def _submit_sdma(self, node: GraphNode, engine: int, node_futs: dict, head: list, deps: dict) -> GPUFuture:
        hub = self.runtime.hub
        fut = node_futs[node]
        dev = self._copy_device(node)
        fut.device, fut.kind, fut.nbytes = dev, "copy", node.op["dst"].nbytes
        src, dst = node.op["src"], node.op["dst"]
        ptr = lambda s, side: s.address if isinstance(s, Buffer) else node.op[side + "_ptr"]  # noqa: E731
        src_agent, dst_agent = self._copy_agents(node)
        for d, semantic in node.deps.items():
            hub.depend(fut, node_futs[d], semantic=semantic)
        for d in head:
            hub.depend(fut, d, semantic=deps[d])
        waits = [node_futs[d] for d in node.deps] + head
        fut.preds.extend(waits)
        name = dev.engines.submit(engine, ptr(dst, "dst"), dst_agent, ptr(src, "src"), src_agent, dst.nbytes,
                                  [w.signal for w in waits], fut.signal)
        if name is None:
            name = self._fallback_copy(node, fut, dev, waits)
        fut.queue = name
        return fut

    def _fallback_copy(self, node: GraphNode, fut: GPUFuture, dev: Device, waits: list) -> str:
        """The engine chosen at instantiation ran out: this replay copies with a shader."""
        queue = dev.queues[0]
        packets = barrier_and_packets([w.signal for w in waits]) if waits else []
        pkt, word = self._dispatch_packet(dev, node, False)
        pkt.completion_signal.handle = fut.signal
        group = PacketGroup([p for p, _ in packets] + [pkt], [h for _, h in packets] + [word], fut)
        dev._track(fut, queue, [], [], [])
        queue.submit(group)
        return queue.name


class _QueueRef:
    __slots__ = ("device", "queue")

    def __init__(self, device: Device, queue: Any):
        self.device, self.queue = device, queue


def _unlock_all(rt: Any, pins: list) -> None:
    if rt.closed:
        return
    with rt.lock:
        for addr, n in pins:
            rt.host.unlock(addr, n)
