/* aiogpu.cuda._hotc: the CUDA submission hot path in C.
 *
 * Each call does one submission's driver work (a kernel launch or an async copy, then the
 * lane's completion-word write) in one C function, without cuda-bindings' per-call Python
 * objects. No CUDA headers and no link against libcuda: Python hands over the driver's entry
 * points as integers (init), and the prototypes below are declared here from the driver API's
 * documented signatures (CUresult is an int, handles are pointers, CUdeviceptr is a 64-bit
 * unsigned integer).
 *
 * Guarantees:
 * - every argument is converted and range-checked before any driver call; a wrong type raises
 *   TypeError, an out-of-range value OverflowError, and nothing is submitted then;
 * - a call whose entry point was not given to init raises RuntimeError (never a jump to 0);
 * - the GIL is held during the driver calls (microseconds each; see release_gil below), or
 *   released around them after set_release_gil(True);
 * - the result is the first non-zero CUresult as an int (0 on success): when the launch or
 *   copy fails, the completion-word write is skipped.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <limits.h>

/* Whether the driver calls run with the GIL released (set_release_gil). Holding it is the
 * default: the calls take microseconds, and letting go of the GIL for each one hands it to any
 * other runnable Python thread (the waiter thread settling completions) and makes the submitting
 * thread queue to get it back, a switch per submission. */
static int release_gil = 0;
#define DRIVER_CALLS(stmts) do {                                    \
        if (release_gil) { Py_BEGIN_ALLOW_THREADS stmts Py_END_ALLOW_THREADS } \
        else { stmts }                                              \
    } while (0)

typedef int CUresult;
typedef void *CUfunction;
typedef void *CUstream;
typedef void *CUevent;
typedef unsigned long long CUdeviceptr;
typedef void (*CUhostFn)(void *);

typedef CUresult (*launch_fn)(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int,
                              unsigned int, unsigned int, unsigned int, CUstream, void **, void **);
typedef CUresult (*memcpy_fn)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
typedef CUresult (*memop64_fn)(CUstream, CUdeviceptr, uint64_t, unsigned int);
typedef CUresult (*wait_event_fn)(CUstream, CUevent, unsigned int);
typedef CUresult (*record_fn)(CUevent, CUstream);
typedef CUresult (*query_fn)(CUevent);
typedef CUresult (*host_func_fn)(CUstream, CUhostFn, void *);

/* The entry points (all NULL until init). One set per process: they are the driver's. */
static launch_fn p_launch;
static memcpy_fn p_memcpy;
static memop64_fn p_write64;
static memop64_fn p_wait64;
static wait_event_fn p_wait_event;
static record_fn p_record;
static query_fn p_query;
static host_func_fn p_host_func;

/* -- argument conversion (0 on success, -1 with an exception set) ---------------------------- */

/* A 64-bit unsigned value from an int, an object with __index__ (numpy integers), or a handle
 * object with __int__ (cuda-bindings' CUstream, CUevent, CUdeviceptr...). Floats and strings
 * are refused: a handle is never rounded or parsed. */
static int
as_u64(PyObject *obj, unsigned long long *out, const char *what)
{
    PyObject *num;
    if (PyLong_Check(obj)) {
        Py_INCREF(obj);
        num = obj;
    }
    else if (PyFloat_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not float", what);
        return -1;
    }
    else if (Py_TYPE(obj)->tp_as_number != NULL && Py_TYPE(obj)->tp_as_number->nb_index != NULL) {
        num = PyNumber_Index(obj);
        if (num == NULL)
            return -1;
    }
    else if (Py_TYPE(obj)->tp_as_number != NULL && Py_TYPE(obj)->tp_as_number->nb_int != NULL) {
        num = Py_TYPE(obj)->tp_as_number->nb_int(obj);
        if (num == NULL)
            return -1;
        if (!PyLong_Check(num)) {
            PyErr_Format(PyExc_TypeError, "%s: __int__ returned %.100s, not int", what,
                         Py_TYPE(num)->tp_name);
            Py_DECREF(num);
            return -1;
        }
    }
    else {
        PyErr_Format(PyExc_TypeError, "%s must be an int or a handle with __int__, not %.100s",
                     what, Py_TYPE(obj)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(num);
    Py_DECREF(num);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_OverflowError, "%s out of range for an unsigned 64-bit value", what);
        }
        return -1;
    }
    *out = v;
    return 0;
}

static int
as_ptr(PyObject *obj, void **out, const char *what)
{
    unsigned long long v;
    if (as_u64(obj, &v, what) < 0)
        return -1;
    if (v > (unsigned long long)UINTPTR_MAX) {
        PyErr_Format(PyExc_OverflowError, "%s out of range for a pointer", what);
        return -1;
    }
    *out = (void *)(uintptr_t)v;
    return 0;
}

/* A C unsigned int (grid and block dimensions, shared memory bytes); handle objects with only
 * __int__ are not dimensions, so only int and __index__ are taken. */
static int
as_uint(PyObject *obj, unsigned int *out, const char *what)
{
    unsigned long long v;
    if (!PyLong_Check(obj) && (Py_TYPE(obj)->tp_as_number == NULL
                               || Py_TYPE(obj)->tp_as_number->nb_index == NULL)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", what, Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (as_u64(obj, &v, what) < 0)
        return -1;
    if (v > UINT_MAX) {
        PyErr_Format(PyExc_OverflowError, "%s out of range for an unsigned int", what);
        return -1;
    }
    *out = (unsigned int)v;
    return 0;
}

static int
nargs_ok(const char *name, Py_ssize_t nargs, Py_ssize_t lo, Py_ssize_t hi)
{
    if (nargs >= lo && nargs <= hi)
        return 1;
    if (lo == hi)
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, lo, nargs);
    else
        PyErr_Format(PyExc_TypeError, "%s() takes %zd or %zd arguments (%zd given)", name, lo, hi, nargs);
    return 0;
}

static int
ready(const void *fn, const char *name)
{
    if (fn != NULL)
        return 1;
    PyErr_Format(PyExc_RuntimeError, "aiogpu.cuda._hotc.%s: its driver entry point was not given to init()", name);
    return 0;
}

/* -- the calls --------------------------------------------------------------------------------- */

PyDoc_STRVAR(launch_doc,
"launch(func, gx, gy, gz, bx, by, bz, shmem, stream, params, word=0, ticket=0) -> int\n\n"
"cuLaunchKernel(func, grid, block, shmem, stream, params, NULL); then, when the launch\n"
"succeeded and word is non-zero, cuStreamWriteValue64(stream, word, ticket, 0).\n"
"Returns the first non-zero CUresult (0 when both succeeded).");

static PyObject *
hot_launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *func, *stream, *params;
    unsigned int dims[7];
    unsigned long long word = 0, ticket = 0;
    static const char *const dim_names[7] = {"gx", "gy", "gz", "bx", "by", "bz", "shmem"};
    (void)self;
    if (!nargs_ok("launch", nargs, 10, 12))
        return NULL;
    if (nargs == 11) {
        PyErr_SetString(PyExc_TypeError, "launch(): word and ticket go together");
        return NULL;
    }
    if (as_ptr(args[0], &func, "func") < 0)
        return NULL;
    for (int i = 0; i < 7; i++)
        if (as_uint(args[1 + i], &dims[i], dim_names[i]) < 0)
            return NULL;
    if (as_ptr(args[8], &stream, "stream") < 0 || as_ptr(args[9], &params, "params") < 0)
        return NULL;
    if (nargs == 12 && (as_u64(args[10], &word, "word") < 0 || as_u64(args[11], &ticket, "ticket") < 0))
        return NULL;
    if (!ready((const void *)p_launch, "launch") || (word != 0 && !ready((const void *)p_write64, "launch")))
        return NULL;
    CUresult rc;
    DRIVER_CALLS(
    rc = p_launch(func, dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], stream,
                  (void **)params, NULL);
    if (rc == 0 && word != 0)
        rc = p_write64(stream, (CUdeviceptr)word, (uint64_t)ticket, 0);
    );
    return PyLong_FromLong(rc);
}

PyDoc_STRVAR(memcpy_doc,
"memcpy(dst, src, nbytes, stream, word=0, ticket=0) -> int\n\n"
"cuMemcpyAsync(dst, src, nbytes, stream); then, when it succeeded and word is non-zero,\n"
"cuStreamWriteValue64(stream, word, ticket, 0). Returns the first non-zero CUresult.");

static PyObject *
hot_memcpy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long dst, src, nbytes, word = 0, ticket = 0;
    void *stream;
    (void)self;
    if (!nargs_ok("memcpy", nargs, 4, 6))
        return NULL;
    if (nargs == 5) {
        PyErr_SetString(PyExc_TypeError, "memcpy(): word and ticket go together");
        return NULL;
    }
    if (as_u64(args[0], &dst, "dst") < 0 || as_u64(args[1], &src, "src") < 0
        || as_u64(args[2], &nbytes, "nbytes") < 0 || as_ptr(args[3], &stream, "stream") < 0)
        return NULL;
    if (nbytes > (unsigned long long)SIZE_MAX) {
        PyErr_SetString(PyExc_OverflowError, "nbytes out of range for size_t");
        return NULL;
    }
    if (nargs == 6 && (as_u64(args[4], &word, "word") < 0 || as_u64(args[5], &ticket, "ticket") < 0))
        return NULL;
    if (!ready((const void *)p_memcpy, "memcpy") || (word != 0 && !ready((const void *)p_write64, "memcpy")))
        return NULL;
    CUresult rc;
    DRIVER_CALLS(
    rc = p_memcpy((CUdeviceptr)dst, (CUdeviceptr)src, (size_t)nbytes, stream);
    if (rc == 0 && word != 0)
        rc = p_write64(stream, (CUdeviceptr)word, (uint64_t)ticket, 0);
    );
    return PyLong_FromLong(rc);
}

PyDoc_STRVAR(write64_doc,
"write64(stream, word, value) -> int\n\ncuStreamWriteValue64(stream, word, value, 0).");

static PyObject *
hot_write64(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *stream;
    unsigned long long word, value;
    (void)self;
    if (!nargs_ok("write64", nargs, 3, 3) || as_ptr(args[0], &stream, "stream") < 0
        || as_u64(args[1], &word, "word") < 0 || as_u64(args[2], &value, "value") < 0
        || !ready((const void *)p_write64, "write64"))
        return NULL;
    CUresult rc;
    DRIVER_CALLS(
    rc = p_write64(stream, (CUdeviceptr)word, (uint64_t)value, 0);
    );
    return PyLong_FromLong(rc);
}

PyDoc_STRVAR(wait64_doc,
"wait64(stream, word, value, flags) -> int\n\ncuStreamWaitValue64(stream, word, value, flags).");

static PyObject *
hot_wait64(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *stream;
    unsigned long long word, value;
    unsigned int flags;
    (void)self;
    if (!nargs_ok("wait64", nargs, 4, 4) || as_ptr(args[0], &stream, "stream") < 0
        || as_u64(args[1], &word, "word") < 0 || as_u64(args[2], &value, "value") < 0
        || as_uint(args[3], &flags, "flags") < 0 || !ready((const void *)p_wait64, "wait64"))
        return NULL;
    CUresult rc;
    DRIVER_CALLS(
    rc = p_wait64(stream, (CUdeviceptr)word, (uint64_t)value, flags);
    );
    return PyLong_FromLong(rc);
}

PyDoc_STRVAR(wait_event_doc,
"wait_event(stream, event) -> int\n\ncuStreamWaitEvent(stream, event, 0).");

static PyObject *
hot_wait_event(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *stream, *event;
    (void)self;
    if (!nargs_ok("wait_event", nargs, 2, 2) || as_ptr(args[0], &stream, "stream") < 0
        || as_ptr(args[1], &event, "event") < 0 || !ready((const void *)p_wait_event, "wait_event"))
        return NULL;
    CUresult rc;
    DRIVER_CALLS(
    rc = p_wait_event(stream, event, 0);
    );
    return PyLong_FromLong(rc);
}

PyDoc_STRVAR(record_doc, "record(event, stream) -> int\n\ncuEventRecord(event, stream).");

static PyObject *
hot_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *event, *stream;
    (void)self;
    if (!nargs_ok("record", nargs, 2, 2) || as_ptr(args[0], &event, "event") < 0
        || as_ptr(args[1], &stream, "stream") < 0 || !ready((const void *)p_record, "record"))
        return NULL;
    CUresult rc;
    DRIVER_CALLS(
    rc = p_record(event, stream);
    );
    return PyLong_FromLong(rc);
}

PyDoc_STRVAR(query_doc, "query(event) -> int\n\ncuEventQuery(event).");

static PyObject *
hot_query(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *event;
    (void)self;
    if (!nargs_ok("query", nargs, 1, 1) || as_ptr(args[0], &event, "event") < 0
        || !ready((const void *)p_query, "query"))
        return NULL;
    CUresult rc;
    DRIVER_CALLS(
    rc = p_query(event);
    );
    return PyLong_FromLong(rc);
}

PyDoc_STRVAR(host_func_doc,
"host_func(stream, fn, data) -> int\n\n"
"cuLaunchHostFunc(stream, fn, data): fn is the address of a C function void fn(void *)\n"
"(e.g. libc's sem_post) that the driver's thread calls with data; it must not be 0.");

static PyObject *
hot_host_func(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *stream, *fn, *data;
    (void)self;
    if (!nargs_ok("host_func", nargs, 3, 3) || as_ptr(args[0], &stream, "stream") < 0
        || as_ptr(args[1], &fn, "fn") < 0 || as_ptr(args[2], &data, "data") < 0
        || !ready((const void *)p_host_func, "host_func"))
        return NULL;
    if (fn == NULL) {
        /* the driver would call address 0 on its own thread */
        PyErr_SetString(PyExc_ValueError, "host_func(): fn must not be 0");
        return NULL;
    }
    CUhostFn cfn;
    /* object pointer -> function pointer: what dlsym users do; fine on every platform CUDA runs */
    memcpy(&cfn, &fn, sizeof cfn);
    CUresult rc;
    DRIVER_CALLS(
    rc = p_host_func(stream, cfn, data);
    );
    return PyLong_FromLong(rc);
}

PyDoc_STRVAR(init_doc,
"init(launch, memcpy, write64, wait64, wait_event, record, query, host_func) -> None\n\n"
"Set the driver entry points (addresses as ints; 0 leaves that call unavailable, and calling\n"
"it raises RuntimeError): cuLaunchKernel, cuMemcpyAsync, cuStreamWriteValue64 (the _v2 entry\n"
"point, as cuda-bindings uses), cuStreamWaitValue64 (_v2), cuStreamWaitEvent, cuEventRecord,\n"
"cuEventQuery, cuLaunchHostFunc. Replaces every earlier setting; all arguments are checked\n"
"before any is set.");

static PyObject *
hot_init(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[8] = {"launch", "memcpy", "write64", "wait64", "wait_event",
                                         "record", "query", "host_func"};
    void *p[8];
    (void)self;
    if (!nargs_ok("init", nargs, 8, 8))
        return NULL;
    for (int i = 0; i < 8; i++) {
        if (!PyLong_Check(args[i])) {   /* entry points are plain ints, never handle objects */
            PyErr_Format(PyExc_TypeError, "init(): %s must be an int, not %.100s", names[i],
                         Py_TYPE(args[i])->tp_name);
            return NULL;
        }
        if (as_ptr(args[i], &p[i], names[i]) < 0)
            return NULL;
    }
    memcpy(&p_launch, &p[0], sizeof p_launch);
    memcpy(&p_memcpy, &p[1], sizeof p_memcpy);
    memcpy(&p_write64, &p[2], sizeof p_write64);
    memcpy(&p_wait64, &p[3], sizeof p_wait64);
    memcpy(&p_wait_event, &p[4], sizeof p_wait_event);
    memcpy(&p_record, &p[5], sizeof p_record);
    memcpy(&p_query, &p[6], sizeof p_query);
    memcpy(&p_host_func, &p[7], sizeof p_host_func);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(entry_points_doc,
"entry_points() -> tuple\n\nThe eight entry points as init() took them (0 where unset), in init()'s order.");

static PyObject *
hot_entry_points(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const void *p[8];
    (void)self;
    (void)args;
    if (!nargs_ok("entry_points", nargs, 0, 0))
        return NULL;
    memcpy(&p[0], &p_launch, sizeof p[0]);
    memcpy(&p[1], &p_memcpy, sizeof p[1]);
    memcpy(&p[2], &p_write64, sizeof p[2]);
    memcpy(&p[3], &p_wait64, sizeof p[3]);
    memcpy(&p[4], &p_wait_event, sizeof p[4]);
    memcpy(&p[5], &p_record, sizeof p[5]);
    memcpy(&p[6], &p_query, sizeof p[6]);
    memcpy(&p[7], &p_host_func, sizeof p[7]);
    return Py_BuildValue("(KKKKKKKK)",
                         (unsigned long long)(uintptr_t)p[0], (unsigned long long)(uintptr_t)p[1],
                         (unsigned long long)(uintptr_t)p[2], (unsigned long long)(uintptr_t)p[3],
                         (unsigned long long)(uintptr_t)p[4], (unsigned long long)(uintptr_t)p[5],
                         (unsigned long long)(uintptr_t)p[6], (unsigned long long)(uintptr_t)p[7]);
}

PyDoc_STRVAR(set_release_gil_doc,
"set_release_gil(flag) -> bool\n\nWhether later driver calls release the GIL; returns the previous setting.");

static PyObject *
hot_set_release_gil(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (!nargs_ok("set_release_gil", nargs, 1, 1))
        return NULL;
    int flag = PyObject_IsTrue(args[0]);
    if (flag < 0)
        return NULL;
    int previous = release_gil;
    release_gil = flag;
    return PyBool_FromLong(previous);
}

static PyMethodDef hot_methods[] = {
    {"set_release_gil", (PyCFunction)(void (*)(void))hot_set_release_gil, METH_FASTCALL, set_release_gil_doc},
    {"entry_points", (PyCFunction)(void (*)(void))hot_entry_points, METH_FASTCALL, entry_points_doc},
    {"init", (PyCFunction)(void (*)(void))hot_init, METH_FASTCALL, init_doc},
    {"launch", (PyCFunction)(void (*)(void))hot_launch, METH_FASTCALL, launch_doc},
    {"memcpy", (PyCFunction)(void (*)(void))hot_memcpy, METH_FASTCALL, memcpy_doc},
    {"write64", (PyCFunction)(void (*)(void))hot_write64, METH_FASTCALL, write64_doc},
    {"wait64", (PyCFunction)(void (*)(void))hot_wait64, METH_FASTCALL, wait64_doc},
    {"wait_event", (PyCFunction)(void (*)(void))hot_wait_event, METH_FASTCALL, wait_event_doc},
    {"record", (PyCFunction)(void (*)(void))hot_record, METH_FASTCALL, record_doc},
    {"query", (PyCFunction)(void (*)(void))hot_query, METH_FASTCALL, query_doc},
    {"host_func", (PyCFunction)(void (*)(void))hot_host_func, METH_FASTCALL, host_func_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef hot_module = {
    PyModuleDef_HEAD_INIT,
    "aiogpu.cuda._hotc",
    "The CUDA submission hot path in C (see aiogpu/cuda/_hotc.c); driver entry points come from init().",
    -1,
    hot_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__hotc(void)
{
    return PyModule_Create(&hot_module);
}
