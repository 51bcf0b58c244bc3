# The ports as extension types with C fields (_loops.py is the source; this only types it): an
# await's admission and the port lookup are C code. The tunables (WAKE_SLICE, TURN_BUDGET_S, ...)
# stay module globals, read when used (tests set them).
cimport cython

cdef class Callback:
    cdef public object fn, arg
    cpdef run(self)

cdef class _Slots:
    cdef public Py_ssize_t slice, used
    cdef public double _cost
    cdef public Py_ssize_t _floor
    cpdef bint take(self)
    cpdef next_turn(self, seconds, used, backlog)

cdef class _Port:
    cdef public object _queue, _lock
    cdef public bint _scheduled
    cdef public _Slots _slots
    cpdef bint _put(self, object items, bint first=*)
    cpdef bint admit(self, bint woken=*)
    cpdef _hand_on(self, object items)
    cpdef _wake(self, object awaiter)

cdef class AsyncioPort(_Port):
    cdef public object _loop
    cdef public bint _marked
    cdef public double _mark
    @cython.locals(slots=_Slots)
    cpdef bint admit(self, bint woken=*)
    cpdef _wake(self, object awaiter)
    cpdef _count(self, object loop)

cdef class _TrioAwaiter:
    cdef public object task
    cdef public bint done

cdef class TrioPort(_Port):
    cdef public object _token, _lowlevel, _finished
    cdef public Py_ssize_t _running
    cdef public double _began, _ended
    cpdef bint admit(self, bint woken=*)
    cpdef _wake(self, object awaiter)

cdef object _modules, _get_running_loop
cdef AsyncioPort _last_port
cpdef object current_port()
