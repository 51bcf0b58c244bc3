"""Graphs on HSA: replays as prebuilt AQL packet lists.

At instantiation each node gets a lane (a compute queue, or an SDMA engine for copies while one
is free) and each queue's packets are built once, with kernargs in memory the graph owns. A
replay publishes each queue's list (every body, then every header in order), issues SDMA copies
with their dependency signals, and joins the queues' tails with a barrier-AND whose signal is the
replay's future. Every replay takes fresh signals, so none can reset a signal an earlier replay
may still read.
"""
from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import struct
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..device import check_args
from ..errors import GPUError
from .._core.submit import Part
from ..futures import GPUFuture
from ..graph import Graph, GraphExec, GraphNode
from ..hsa_bindings import packets as P
from ..kernels import copy_kernel
from ..memory import Buffer
from .queues import PacketGroup, barrier_and_packets
from .device import HsaDevice as Device
from .kernels import pack_args

log = logging.getLogger("aiogpu")

COMPLETION_OFFSET = P.hsa_kernel_dispatch_packet_t.completion_signal.offset
DEP_OFFSET = P.hsa_barrier_and_packet_t.dep_signal.offset
GRID_OFFSET = P.hsa_kernel_dispatch_packet_t.workgroup_size_x.offset


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


class HsaGraphExec(GraphExec):
    """An instantiated graph on HSA: per-queue prebuilt packets (see the module doc)."""

    def __init__(self, graph: Graph):
        super().__init__(graph)
        self._last: GPUFuture | None = None
        # What the executable owns, given back when it is closed or collected (see _Owned).
        owned = self._owned = _Owned(self.runtime)
        ref = weakref.ref(self, lambda r: (_OWNED.discard(r), owned.release()))
        _OWNED.add(ref)
        try:                              # (under the runtime lock: Runtime.instantiate)
            self._prepare_host_memory()
            self._plan_lanes()
            self._build()
        except BaseException:
            owned.release()
            raise

    def _release(self) -> None:
        self._owned.release()

    # -- instantiation ---------------------------------------------------------------------------
    def _prepare_host_memory(self) -> None:
        """Host arrays that copies read or write stay locked while the executable is open."""
        rt, pins = self.runtime, self._owned.pins
        for node in self.nodes:
            if node.kind == "copy":
                for side in ("dst", "src"):
                    arr = node.op[side]
                    if isinstance(arr, np.ndarray):
                        addr = arr.__array_interface__["data"][0]
                        node.op[side + "_ptr"] = rt.host.lock(addr, arr.nbytes, arr)
                        pins.append((addr, arr.nbytes))

    def _plan_lanes(self) -> None:
        """Each node gets a lane: a compute queue (launches, gathers, shader copies) or an SDMA
        engine (copies while one is free at instantiation)."""
        self.lane_of: dict[GraphNode, Any] = {}
        self.engine_of: dict[GraphNode, int] = {}
        rr = itertools.count()
        for node in self.nodes:
            if node.kind == "copy":
                dev = self.copy_device(node)
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
        self._shader_copies = sum(node.kind == "shader-copy" for node in self.nodes)   # per replay (stats)

    def _node_device(self, node: GraphNode) -> Device:
        if node.kind == "launch":
            return node.op["device"]
        if node.kind == "shader-copy":
            return self.copy_device(node)
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
        """The node's dispatch packet, its kernargs in graph-owned memory (built once)."""
        pkt, header, data, align = self._unplaced_dispatch(device, node, barrier)
        pkt.kernarg_address = self._graph_kernarg(device, data, align)
        return pkt, header

    def _unplaced_dispatch(self, device: Device, node: GraphNode, barrier: bool) -> tuple[Any, int, bytes, int]:
        """(packet, header, kernarg bytes, their alignment): the packet without its kernarg
        address."""
        kernel, grid, block, values, lengths = self._dispatch_args(device, node, node.op.get("args"))
        loaded = device._loaded_kernel(kernel)
        data = pack_args(loaded, values, lengths, grid, block)
        pkt = P.hsa_kernel_dispatch_packet_t()
        dims = len(grid)
        pkt.workgroup_size_x, pkt.workgroup_size_y, pkt.workgroup_size_z = tuple(block) + (1,) * (3 - dims)
        pkt.grid_size_x, pkt.grid_size_y, pkt.grid_size_z = tuple(grid) + (1,) * (3 - dims)
        pkt.private_segment_size = loaded.private_segment_size
        pkt.group_segment_size = loaded.group_segment_size
        pkt.kernel_object = loaded.kernel_object
        header = P.make_header(P.HSA_PACKET_TYPE_KERNEL_DISPATCH, barrier=barrier)
        return pkt, header | dims << 16, data, loaded.kernarg_align

    def _dispatch_args(self, device: Device, node: GraphNode, args: Any) -> tuple:
        if node.kind == "launch":
            kernel = node.op["kernel"]
            values, lengths, _ = check_args(device, kernel, args)
            return kernel, node.op["grid"], node.op["block"], values, lengths
        src, dst = node.op["src"], node.op["dst"]
        n = dst.nbytes
        ptr = lambda s, side: s.address if isinstance(s, Buffer) else node.op[side + "_ptr"]  # noqa: E731
        return copy_kernel, device._copy_grid(n), (256,), [ptr(dst, "dst"), ptr(src, "src"), n], [n, n]

    def _graph_kernarg(self, device: Device, data: bytes, align: int = 64) -> int:
        """Graph-owned kernarg memory for ``data``, aligned to ``align`` (the kernel's
        kernarg_segment_align, at least 64)."""
        align = max(align, 64)
        blocks = self._owned.blocks
        if blocks:   # skip to the alignment inside the current block
            pad = -self._kernarg_next % align
            self._kernarg_next += pad
            self._kernarg_room -= pad
        address, size = self.runtime._kernarg_block(device.agent) if not blocks or \
            self._kernarg_room < len(data) else (None, None)
        if address is not None:
            blocks.append(address)
            self._kernarg_next, self._kernarg_room = address, size
        address = self._kernarg_next
        ctypes.memmove(address, data, len(data))
        step = (len(data) + 63) // 64 * 64
        self._kernarg_next += step
        self._kernarg_room -= step
        return address

    def home_device(self) -> Device:
        return next(iter(self.lanes.values())).device if self.lanes else self.runtime.devices[0]

    def _replay_parts(self, patches: dict, deps: dict) -> tuple:
        """(home device, parts, plan) of one replay (``GraphExecHooks``): a part per signaled
        node (one a lane or an engine waits for: its packet's completion, or the engine copy),
        then one per lane (its packets, ending in a barrier whose signal says the lane is done).
        Engine copies and lanes are joined into the replay. Replays run in launch order: the
        previous one joins ``deps``. Packing the patched arguments comes first: whatever can
        fail does before any future exists."""
        packed = {node: pack_args(node.op["device"]._loaded_kernel(node.op["kernel"]), p["values"], p["lengths"],
                                  p["grid"], p["block"])
                  for node, p in patches.items()}
        if self._last is not None and not self._last.retired:
            deps.setdefault(self._last, False)
        nodes = list(self.signaled)
        index = {node: i for i, node in enumerate(nodes)}
        parts = []
        lane_waits = {name: [index[dep] for _, _, dep in lane.waits] for name, lane in self.lanes.items()}
        for node in nodes:
            label = f"{node.label} (replay {self.replays})"
            if node in self.engine_of:
                parts.append(Part(label, self.copy_device(node), "copy", joined=True, after_head=True, on_head=True,
                                  depends=[(index[d], semantic) for d, semantic in node.deps.items()],
                                  preds=[index[d] for d in node.deps]))
            else:       # a node is ordered after its lane's waits
                name = self.lane_of[node].queue.name
                parts.append(Part(label, self.lanes[name].device, "dispatch", after_head=True,
                                  preds=lane_waits[name]))
        for name, lane in self.lanes.items():
            waits = lane_waits[name]
            parts.append(Part(f"graph lane {name} (replay {self.replays})", lane.device, "graph", joined=True,
                              after_head=True, on_head=True, depends=[(i, True) for i in waits], preds=waits))
        return self.home_device(), parts, (nodes, index, patches, packed)

    def _encode_parts(self, plan: tuple, replay: GPUFuture, futs: list, head: list) -> tuple[list, list]:
        """Queue a replay's parts (``futs``, as ``_replay_parts`` named them) and its join on
        the home device's first queue, completing ``replay``; (each part's cleanup, the
        replay's)."""
        nodes, index, patches, packed = plan
        node_futs = dict(zip(nodes, futs))
        cleanups = [[] for _ in futs]
        for i, node in enumerate(nodes):
            if node not in self.engine_of:    # (marks retire with their lane)
                cleanups[i].append(functools.partial(self.lane_of[node].queue.inflight.pop, futs[i], None))
        done = []
        for k, lane in enumerate(self.lanes.values()):
            segment = futs[len(nodes) + k]
            self._encode_lane(lane, segment, node_futs, head, patches, packed)
            cleanups[len(nodes) + k].append(functools.partial(lane.queue.retired, segment))
            done.append(segment)
        for node, engine in self.engine_of.items():
            i = index[node]
            cleanups[i] += self._encode_sdma(node, engine, futs[i], node_futs, head)
            done.append(futs[i])
        self.runtime.shader_copies += self._shader_copies
        first = self.home_device().queues[0]
        packets = barrier_and_packets([p.signal for p in done], replay.signal)
        first.submit(PacketGroup([p for p, _ in packets], [h for _, h in packets], replay))
        self._last = replay
        return cleanups, [functools.partial(first.retired, replay)]

    def _encode_lane(self, lane: _Lane, segment: GPUFuture, node_futs: dict, head: list, patches: dict,
                     packed: dict) -> None:
        blob = bytearray(lane.blob)
        for i, node in lane.completions:
            struct.pack_into("<Q", blob, i * 64 + COMPLETION_OFFSET, node_futs[node].signal)
        kernargs, align = {}, 16
        for node, p in patches.items():
            i = lane.dispatch_at.get(node)
            if i is None:
                continue
            kernargs[i] = packed[node]
            align = max(align, lane.device._loaded_kernel(node.op["kernel"]).kernarg_align)
            g3 = tuple(p["grid"]) + (1,) * (3 - len(p["grid"]))
            b3 = tuple(p["block"]) + (1,) * (3 - len(p["block"]))
            struct.pack_into("<HHHHIII", blob, i * 64 + GRID_OFFSET, *b3, 0, *g3)
        headers = list(lane.headers)
        for node, p in patches.items():
            i = lane.dispatch_at.get(node)
            if i is not None:
                headers[i] = (headers[i] & 0xFFFF) | len(p["grid"]) << 16
        for i, slot, dep in lane.waits:
            struct.pack_into("<Q", blob, i * 64 + DEP_OFFSET + 8 * slot, node_futs[dep].signal)
        pre = barrier_and_packets([d.signal for d in head]) if head else []
        tail, tail_header = barrier_and_packets([], segment.signal, barrier=True)[0]
        blob = bytearray(b"".join(bytes(p) for p, _ in pre)) + blob + bytearray(bytes(tail))
        headers = [h for _, h in pre] + headers + [tail_header]
        offset = len(pre)
        marks = [(node_futs[n], offset + i) for i, n in lane.completions]
        kernargs = {offset + i: data for i, data in kernargs.items()}
        lane.queue.submit(PacketGroup([], headers, segment, blob=blob, marks=marks, kernargs=kernargs,
                                      kernarg_align=align))

    def _encode_sdma(self, node: GraphNode, engine: int, fut: GPUFuture, node_futs: dict, head: list) -> list:
        """Issue a copy node on its engine (or, when the engine refuses it now, as a shader
        copy); its cleanup."""
        dev = self.copy_device(node)
        fut.nbytes = node.op["dst"].nbytes
        src, dst = node.op["src"], node.op["dst"]
        ptr = lambda s, side: s.address if isinstance(s, Buffer) else node.op[side + "_ptr"]  # noqa: E731
        src_agent, dst_agent = self._copy_agents(node)
        waits = [node_futs[d] for d in node.deps] + head
        done: list = []
        try:
            name = dev.engines.submit(engine, ptr(dst, "dst"), dst_agent, ptr(src, "src"), src_agent,
                                      dst.nbytes, [w.signal for w in waits], fut.signal, done)
        except GPUError:
            # Any other failure of the copy call: by now this replay's futures exist and its
            # other parts run, waiting on this node's signal; raising would leave them pending
            # for good. aiogpu's own copy does the node's work instead.
            name = None
        if name is not None:
            fut.queue = name
            return done
        self.runtime.shader_copies += 1
        return self._fallback_copy(node, fut, dev, waits)

    def _fallback_copy(self, node: GraphNode, fut: GPUFuture, dev: Device, waits: list) -> list:
        """The engine chosen at instantiation ran out: this replay copies with a shader. Its
        kernargs go in the queue's ring, freed when it retires (the executable's blocks hold
        what every replay reads, written once); its cleanup."""
        queue = dev.queues[0]
        packets = barrier_and_packets([w.signal for w in waits]) if waits else []
        pkt, word, data, align = self._unplaced_dispatch(dev, node, False)
        pkt.completion_signal.handle = fut.signal
        group = PacketGroup([p for p, _ in packets] + [pkt], [h for _, h in packets] + [word], fut,
                            data, kernarg_align=align)
        queue.submit(group)
        fut.queue = queue.name
        return [functools.partial(queue.retired, fut)]


class _QueueRef:
    __slots__ = ("device", "queue")

    def __init__(self, device: Device, queue: Any):
        self.device, self.queue = device, queue


class _Owned:
    """What an executable owns: its kernarg blocks (``HsaRuntime._kernarg_block``) and the host
    ranges its copies locked. ``release`` gives them back, once (the executable was closed
    after its last replay retired, or collected: its replays hold it until they retire, so no
    packet can still read its kernargs or its host memory). After the runtime's close there is
    nothing to do: the runtime frees every block and lock itself."""

    __slots__ = ("runtime", "blocks", "pins")

    def __init__(self, runtime: Any):
        self.runtime = runtime
        self.blocks: list[int] = []
        self.pins: list[tuple[int, int]] = []

    def release(self) -> None:
        rt = self.runtime
        if rt.closed:
            return
        with rt.lock:
            if rt.closed:
                return
            blocks, self.blocks = self.blocks, []
            pins, self.pins = self.pins, []
            # (Runs where a replay retires, on the waiter thread too: one failed release is
            # logged and stops neither the others nor the retirement.)
            for release, items in ((lambda p: rt.host.unlock(*p), pins), (rt._release_kernarg_block, blocks)):
                for item in items:
                    try:
                        release(item)
                    except Exception:  # noqa: BLE001
                        log.exception("releasing %r of a graph executable failed", item)


# The weak references that release collected executables (``_Owned``), kept alive here until
# they call back. Not weakref.finalize: its exit function walks a global registry, which the
# waiter thread changes while work retires during the interpreter's exit.
_OWNED: set[weakref.ref] = set()
