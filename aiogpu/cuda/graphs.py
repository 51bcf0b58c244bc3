"""Graphs as CUDA graphs: one node per captured operation, edges from ``GraphNode.deps``.

- launches become kernel nodes, copies memcpy nodes (host arrays stay registered for the
  executable's life), joins empty nodes; the graph is instantiated once;
- a replay is ``cuGraphLaunch`` on the executable's own lane, after device-side waits for the
  work outside the graph it conflicts with, then an event record: one future per replay.
  Replays of one executable share that lane, so they run in launch order;
- patches (``args=``/``grid=``/``block=``) are checked before anything is submitted, applied
  with ``cuGraphExecKernelNodeSetParams`` just before that replay's launch and undone before the
  next replay that does not patch the node (a set-params call affects only later launches,
  never those already queued);
- a failing node is a sticky CUDA error: it fails that replay's future and every pending
  future of the device (see waiter.py), not only the replay.
"""
from __future__ import annotations

import functools
import itertools
from typing import Any


from ..device import check_args
from ..graph import GraphExec, GraphNode
from ..memory import Buffer
from . import driver as D
from .driver import cu
from .streams import Lane

_ids = itertools.count()


class CudaGraphExec(GraphExec):
    """An instantiated graph on CUDA. ``launch()`` replays it and returns one GPUFuture."""

    def __init__(self, graph: Any):
        super().__init__(graph)
        self._pins: list = []
        self._keep: list = []
        self._patched: set = set()    # nodes whose parameters differ from the captured ones
        self._destroy_after = False   # destroy once the replays on its lane have retired
        self.exec = self.cugraph = self.lane = None
        try:
            self._build()             # (under the runtime lock: Runtime.instantiate)
        except BaseException:
            self.destroy()
            raise

    def _device(self) -> Any:
        for node in self.nodes:
            if node.kind == "launch":
                return node.op["device"]
            if node.kind == "copy":
                return self.copy_device(node)
        return self.runtime.devices[0]

    def _build(self) -> None:
        rt = self.runtime
        self.device = dev0 = self._device()
        dev0.make_current()
        g = D.check(cu.cuGraphCreate(0), "cuGraphCreate")
        self.cugraph = g
        self.cu_nodes: dict[GraphNode, Any] = {}
        self.current: dict[GraphNode, tuple] = {}
        self.original: dict[GraphNode, tuple] = {}
        for node in self.nodes:
            deps = [self.cu_nodes[d] for d in node.deps]
            if node.kind == "launch":
                dev, kernel = node.op["device"], node.op["kernel"]
                values, _, _ = check_args(dev, kernel, node.op["args"])
                state = (tuple(values), *dev.blocks(node.op["grid"], node.op["block"]))
                params = self._kernel_params(dev, kernel, state)
                h = D.check(cu.cuGraphAddKernelNode(g, deps, len(deps), params), "cuGraphAddKernelNode")
                self.current[node] = self.original[node] = state
            elif node.kind == "copy":
                dev = self.copy_device(node)
                h = D.check(cu.cuGraphAddMemcpyNode(g, deps, len(deps), self._memcpy_params(node), dev.ctx),
                            "cuGraphAddMemcpyNode")
            else:
                h = D.check(cu.cuGraphAddEmptyNode(g, deps, len(deps)), "cuGraphAddEmptyNode")
            self.cu_nodes[node] = h
        dev0.make_current()
        self.exec = D.check(cu.cuGraphInstantiate(g, 0), "cuGraphInstantiate")
        self.lane = Lane(dev0, f"{dev0.name}.graph{next(_ids)}", "graph")
        dev0.lanes.append(self.lane)
        rt.hub.lanes.append(self.lane)

    def _kernel_params(self, dev: Any, kernel: Any, state: tuple) -> Any:
        values, grid3, block3 = state
        loaded = dev._loaded_kernel(kernel)
        address, keep = loaded.packed_copy(values)
        self._keep.append(keep)
        p = cu.CUDA_KERNEL_NODE_PARAMS()
        p.func = loaded.func
        p.gridDimX, p.gridDimY, p.gridDimZ = grid3
        p.blockDimX, p.blockDimY, p.blockDimZ = block3
        p.sharedMemBytes = 0
        p.kernelParams = address
        return p

    def _memcpy_params(self, node: GraphNode) -> Any:
        src, dst = node.op["src"], node.op["dst"]
        n = dst.nbytes
        p = cu.CUDA_MEMCPY3D()
        p.srcMemoryType = p.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_UNIFIED
        p.srcDevice = self._pointer(src)
        p.dstDevice = self._pointer(dst)
        p.WidthInBytes, p.Height, p.Depth = n, 1, 1
        p.srcPitch = p.dstPitch = n
        p.srcHeight = p.dstHeight = 1
        return p

    def _pointer(self, side: Any) -> int:
        if isinstance(side, Buffer):
            return side.address
        got = self.runtime.host.pin(side)
        if got is None:
            raise ValueError("a host array of this graph shares pages with a registration in use; "
                             "copy it into an array of its own")
        ptr, release = got
        self._pins.append(release)
        return ptr

    # -- replay ----------------------------------------------------------------------------------
    def home_device(self) -> Any:
        return self.device

    def _replay_work(self, patches: dict) -> tuple:
        """``cuGraphLaunch`` on the executable's own lane (replays run in launch order), with
        kernel-node patches applied just before it and undone before an unpatched replay."""
        if self.exec is None:
            raise ValueError("this graph executable was destroyed")
        wanted = {node: (tuple(p["values"]), *node.op["device"].blocks(p["grid"], p["block"]))
                  for node, p in patches.items()}
        return self.device, self.lane, functools.partial(self._encode_replay, wanted)

    def _encode_replay(self, wanted: dict, fut: Any, lane: Any, waits: Any, cleanup: list) -> tuple:
        cleanup.append(self._replay_retired_on_lane)
        return self.runtime._encode_on_lane(fut, lane, waits, cleanup, functools.partial(self._launch, wanted))

    def _launch(self, wanted: dict, stream: int, word: int, ticket: int) -> int:
        # Only nodes patched now or by an earlier replay can differ from their original:
        # an unpatched replay of an unpatched executable touches no node.
        for node in self._patched | wanted.keys():
            want = wanted.get(node, self.original[node])
            if self.current[node] != want:
                params = self._kernel_params(node.op["device"], node.op["kernel"], want)
                (err,) = cu.cuGraphExecKernelNodeSetParams(self.exec, self.cu_nodes[node], params)
                if err:
                    return err
                self.current[node] = want
                if want == self.original[node]:
                    self._patched.discard(node)
                else:
                    self._patched.add(node)
        if len(self._keep) > 4 * len(self.original) + 64:
            self._keep = self._keep[-2 * len(self.original):]
        return cu.cuGraphLaunch(self.exec, stream)[0]

    def destroy(self) -> None:
        """Free the executable (the runtime does this at close)."""
        rt = self.runtime
        if self.exec is not None:
            cu.cuGraphExecDestroy(self.exec)
            self.exec = None
        if self.cugraph is not None:
            cu.cuGraphDestroy(self.cugraph)
            self.cugraph = None
        if self.lane is not None:
            if self.lane in rt.hub.lanes:
                rt.hub.lanes.remove(self.lane)
            if self.lane in self.lane.device.lanes:
                self.lane.device.lanes.remove(self.lane)
            self.lane.destroy()
            self.lane = None
        if not rt.closed:
            for release in self._pins:
                release()
        self._pins = []

    def __del__(self) -> None:
        try:
            rt = self.runtime
            if not rt.closed and self.exec is not None:
                rt.hub.post_event(self._destroy_when_idle)
        except Exception:  # noqa: BLE001
            pass

    def _release(self) -> None:
        # On the waiter thread: destroying the lane changes the hub's list of lanes it scans.
        self.runtime.hub.post_event(self._destroy_when_idle)

    def _replay_retired_on_lane(self) -> None:
        # (a replay's cleanup, under the lock) the last one to retire after a deferred destroy
        # hands it to the waiter again.
        if self._destroy_after and all(f.retired for f in self.lane.pending):
            self._destroy_after = False
            self.runtime.hub.post_event(self._destroy_when_idle)

    def _destroy_when_idle(self) -> None:
        with self.runtime.lock:
            if self.lane is None or self.runtime.closed:
                return                  # (destroyed already, or the runtime's close does it)
            if any(not f.retired for f in self.lane.pending):
                self._destroy_after = True      # a replay not retired yet: once none is left
                return
            self.lane.device.make_current()
            self.destroy()
