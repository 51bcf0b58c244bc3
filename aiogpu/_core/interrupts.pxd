# The hold state as C variables and the locks as extension types (interrupts.py is the source;
# this only types it).
cimport cython
from cpython.exc cimport PyErr_CheckSignals
from cpython.pythread cimport (PyThread_get_thread_ident, PyThread_type_lock, PyThread_allocate_lock,
                               PyThread_free_lock, PyThread_acquire_lock, PyThread_release_lock,
                               PyLockStatus, PY_LOCK_ACQUIRED, PY_LOCK_INTR)

cdef extern from "pythread.h":
    ctypedef long long PY_TIMEOUT_T
    PyLockStatus PyThread_acquire_lock_timed(PyThread_type_lock, PY_TIMEOUT_T, int) nogil

cdef unsigned long _MAIN
cdef int _depth
cdef object _saved
cdef bint _arrived
cdef object _restore_on
cdef object _default_handler
cdef object _monotonic

cdef int _enter() except -1
cdef object _exit()
cdef int _uninstall() except -1
cdef int _leave(int up=*) except -1

cdef class RawLock:
    cdef PyThread_type_lock _lock
    cdef unsigned long _owner
    cdef Py_ssize_t _count
    cdef object _rlock
    @cython.locals(me=cython.ulong)
    cdef bint _take(self, bint blocking, double timeout) except -1
    @cython.locals(deadline=double, wait_us=PY_TIMEOUT_T, status=PyLockStatus)
    cdef bint _wait(self, double timeout) except -1
    cdef int _give(self) except -1

cdef class InterruptSafeLock:
    cdef public RawLock raw
    cdef public int _held
    cdef public object backlog
    cdef public object drain
    cpdef int enter(self) except -1
    cpdef int exit(self) except -1
    cdef int _exit(self, int up) except -1
