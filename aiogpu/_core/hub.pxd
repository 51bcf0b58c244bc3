# The hub's fields as C slots (hub.py is the source; this only types it). Backends subclass it
# in Python (their waiter's state lives in the subclass).
cimport cython
from aiogpu._core.futures cimport AwaitHub, GPUFuture, make_future
from aiogpu._core.interrupts cimport InterruptSafeLock, RawLock

cdef class Hub(AwaitHub):
    cdef public InterruptSafeLock lock
    cdef public object _backlog
    cdef public set _queued
    cdef public int _slow
    cdef public object watchdog_s
    cdef public bint keys_are_resources
    cdef public long long _last_key
    cdef public dict _pending
    cdef public object _events
    cdef public bint _dirty
    cdef public bint _woken
    cdef public bint _idle
    cdef public bint _stop
    cdef public long long wakeups
    cdef public list leaked
    cdef public object _given_up
    cdef public dict _ready_since
    cdef public object owner
    cdef public object on_timeout
    cdef public object _thread
    cdef object __weakref__

    # (The settling and retiring steps, called as C functions with the future's fields as C
    # slots; ``_retire`` is also the deferred work's.)
    cpdef _unwatch(self, GPUFuture fut)
    @cython.locals(lock=RawLock)
    cpdef _settle_done(self, GPUFuture fut, dict posts)
    cpdef _wake_awaiters(self, GPUFuture fut, object ports, object callbacks, object event, dict posts)
    cpdef _retire(self, GPUFuture fut)
    cpdef _completed(self, GPUFuture fut, object exc, dict posts, bint retire=*)
    cpdef _flush(self, dict posts)
    cpdef _drain(self, object posts=*)
    cpdef _post(self, dict posts, bint here=*)
    # (per operation: the submission calls them as C functions)
    cpdef GPUFuture new_future(self, label)
    cpdef discard(self, GPUFuture fut)
    cpdef watch(self, GPUFuture fut)
    cpdef reap(self)
    cpdef arm(self, GPUFuture fut)
    cpdef _wake_for(self, GPUFuture fut)
