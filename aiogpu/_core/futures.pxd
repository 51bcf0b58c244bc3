# The future's fields as C slots (futures.py is the source; this only types it).
cimport cython
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC
from aiogpu._core.interrupts cimport RawLock
from aiogpu._loops cimport _Port, current_port

cdef class GPUFuture

# What an await asks of the hub (hub.Hub derives from it): its hooks are C calls.
cdef class AwaitHub:
    cdef public RawLock state_lock
    cdef public double spin_s
    cdef public int awaiting
    cpdef bint spin_poll(self, GPUFuture fut) except -1
    cpdef arm(self, GPUFuture fut)
    cpdef parked_done(self, GPUFuture fut)

cdef class GPUFuture:
    cdef public AwaitHub _hub
    cdef public int _state
    cdef public object _exc
    cdef public object signal
    cdef public object _ports
    cdef public object _event
    cdef public object _callbacks
    cdef public object _cleanup
    cdef public object _dependents
    cdef public object _dep_signals
    cdef public object preds
    cdef public object _on_retire
    cdef public bint _retiring
    cdef public bint retired
    cdef public object label
    cdef public object value
    cdef public object device
    cdef public object kind
    cdef public object nbytes
    cdef public object queue
    cdef public object packet
    cdef public object lane
    cdef public double submitted_at
    cdef public object keep
    cdef public object members
    cdef public bint waited
    cdef public object _views
    cdef public long long ticket
    cdef public object event
    cdef public object on_complete
    cdef public object staging
    cdef public object host_deps
    cdef object __weakref__

    cpdef _submitted_work(self)
    cpdef _add_dependent(self, GPUFuture fut)
    cpdef _add_dep_signal(self, key)

@cython.locals(fut=GPUFuture)
cpdef GPUFuture make_future(object hub, object label, object signal)
cdef int _setup(GPUFuture fut, object hub, object label, object signal) except -1

@cython.locals(f=GPUFuture)
cpdef list preds_list(fut)

@cython.locals(ts=timespec)
cdef double _now() except? -1.0
