# The runtime's lock as an extension type (interrupts.py is the source; this only types it).
cdef class InterruptSafeLock:
    cdef public object raw
    cdef public int _held
    cdef public object backlog
    cdef public object drain
