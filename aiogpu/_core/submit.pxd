# Types for submit.py's per-operation functions (the source is submit.py).
cimport cython
from aiogpu._core.futures cimport GPUFuture
from aiogpu._core.hub cimport Hub
from aiogpu._core.hazards cimport BufferState, dependencies, failed_dependency, record
from aiogpu._core.interrupts cimport InterruptSafeLock
from aiogpu._core.state cimport DeviceState, RuntimeState, encode_kernel

cdef class LaneOrder:
    cdef public list lanes
    cdef public Py_ssize_t next
    cdef public bint balances_load

@cython.locals(err=object, resolved=object, blockers=object)
cpdef object guarded(RuntimeState rt, DeviceState device, object label, object reads, object writes, object after,
                     object submit, object compile=*, object deferred_rw=*)

@cython.locals(fut=GPUFuture, order=LaneOrder, lanes=list, i=Py_ssize_t, n=Py_ssize_t, start=Py_ssize_t,
               load=object)
cpdef object pick_lane(DeviceState device, object deps)

@cython.locals(hub=Hub)
cpdef int reap(RuntimeState rt) except -1

@cython.locals(rt=RuntimeState, lock=InterruptSafeLock, plan=tuple, last=tuple, n=Py_ssize_t, i=Py_ssize_t, touches=bint, buffers=dict,
               deps=dict, shape=tuple, kreads=list, kwrites=list, buf=BufferState)
cpdef object launch_plain(DeviceState device, object kernel, object grid, object block, object args)

@cython.locals(fut=GPUFuture, todo=list, own=Py_ssize_t, hub=Hub)
cpdef object launch(RuntimeState rt, DeviceState device, object loaded, object label, object grid, object block,
                    object values, object lengths, dict deps, object reads, object writes, object keep=*,
                    object cleanup=*, object copy=*, object foreign=*)

@cython.locals(dep=GPUFuture, d=GPUFuture, host_deps=list, hub=Hub)
cpdef _submitted(RuntimeState rt, GPUFuture fut, dict deps, object waits, object keys, object reads, object writes,
                 object keep, list cleanup)

cpdef object _refused(RuntimeState rt, GPUFuture fut, object exc, list cleanup, object writes)

cdef class _Held:
    cdef object ranges
    cdef GPUFuture fut
    cdef BufferState first, second
    cdef list more, hosts, cleanup, views
    cdef bint twice

    @cython.locals(views=list, buf=BufferState, root=BufferState)
    cpdef add(self, object s, bint write)
    @cython.locals(fut=GPUFuture, reads=list, n=Py_ssize_t, i=Py_ssize_t, users=Py_ssize_t)
    cpdef release(self, BufferState buf)


@cython.locals(held=_Held)
cdef _Held _new_held(object ranges, GPUFuture fut)


@cython.locals(held=_Held, views=list, d=GPUFuture)
cpdef track(RuntimeState rt, GPUFuture fut, object reads, object writes, object deps=*, object keep=*, object cleanup=*)

@cython.locals(x=object)
cpdef bint plain_ints(tuple shape)

cpdef bint any_deferred(dict deps)

@cython.locals(d=GPUFuture, waits=list)
cpdef list live(dict deps)

@cython.locals(hub=Hub)
cpdef _withdraw(RuntimeState rt, GPUFuture fut, list cleanup)
