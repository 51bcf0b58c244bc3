# The hold state as C variables and the lock as an extension type (interrupts.py is the source;
# this only types it).
from cpython.pythread cimport PyThread_get_thread_ident

cdef unsigned long _MAIN
cdef int _depth
cdef object _saved
cdef bint _arrived
cdef object _restore_on
cdef object _default_handler

cdef int _enter() except -1
cdef object _exit()
cdef int _uninstall() except -1
cdef int _leave() except -1

cdef class InterruptSafeLock:
    cdef public object raw
    cdef public int _held
    cdef public object backlog
    cdef public object drain
    cdef object _acquire
    cdef object _release
