/* A fake libcuda.so.1: the driver entry points aiogpu's C hot path calls (C_ENTRY_POINTS in
 * aiogpu/cuda/driver.py), with the semantics of the fake cuda.bindings beside it: every call
 * returns at once, device memory is host memory (copies are real memmoves), kernels do
 * nothing, completion words are written at submission, host functions run at once on the
 * calling thread. Handles are the ints the Python fake hands out, taken as pointers and never
 * dereferenced (only device pointers and host-function data are).
 *
 * For tests and measurements only. Two extra symbols, which no real driver has:
 * - fakecuda_calls(i): how many times entry point i (FAKECUDA_* below, the order of
 *   C_ENTRY_POINTS) was called, counting calls forwarded;
 * - fakecuda_forward(i, fn): from now on entry point i calls fn (same prototype) instead of
 *   doing its own work (NULL: its own work again). The Python fake's controls use it, so that
 *   what they model (held streams, logged calls, failing queries) holds on the C path too.
 *
 * The prototypes are the driver API's documented signatures (CUresult is an int, handles are
 * pointers, CUdeviceptr a 64-bit unsigned integer), as aiogpu/cuda/_hotc.c declares them.
 */
#include <stdint.h>
#include <string.h>

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

enum {
    FAKECUDA_LAUNCH, FAKECUDA_MEMCPY, FAKECUDA_WRITE64, FAKECUDA_WAIT64, FAKECUDA_WAIT_EVENT,
    FAKECUDA_RECORD, FAKECUDA_QUERY, FAKECUDA_HOST_FUNC, FAKECUDA_N
};

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1

/* Counters are relaxed atomics: the waiter thread queries while the loop thread submits. */
static unsigned long long calls[FAKECUDA_N];
static void *forward[FAKECUDA_N];
#define COUNT(i) __atomic_fetch_add(&calls[i], 1, __ATOMIC_RELAXED)
#define FORWARD(i, type) ((type)__atomic_load_n(&forward[i], __ATOMIC_ACQUIRE))

unsigned long long
fakecuda_calls(int i)
{
    if (i < 0 || i >= FAKECUDA_N)
        return 0;
    return __atomic_load_n(&calls[i], __ATOMIC_RELAXED);
}

int
fakecuda_forward(int i, void *fn)
{
    if (i < 0 || i >= FAKECUDA_N)
        return CUDA_ERROR_INVALID_VALUE;
    __atomic_store_n(&forward[i], fn, __ATOMIC_RELEASE);
    return CUDA_SUCCESS;
}

CUresult
cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
               unsigned int by, unsigned int bz, unsigned int shmem, CUstream stream, void **params,
               void **extra)
{
    launch_fn fw = FORWARD(FAKECUDA_LAUNCH, launch_fn);
    COUNT(FAKECUDA_LAUNCH);
    if (fw)
        return fw(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra);
    return CUDA_SUCCESS;                        /* kernels do nothing */
}

CUresult
cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream)
{
    memcpy_fn fw = FORWARD(FAKECUDA_MEMCPY, memcpy_fn);
    COUNT(FAKECUDA_MEMCPY);
    if (fw)
        return fw(dst, src, n, stream);
    if (n != 0 && (dst == 0 || src == 0))
        return CUDA_ERROR_INVALID_VALUE;
    memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    return CUDA_SUCCESS;
}

static CUresult
write64(CUstream stream, CUdeviceptr addr, uint64_t value, unsigned int flags)
{
    memop64_fn fw = FORWARD(FAKECUDA_WRITE64, memop64_fn);
    COUNT(FAKECUDA_WRITE64);
    if (fw)
        return fw(stream, addr, value, flags);
    if (addr == 0 || addr % 8 != 0)             /* the driver wants an aligned, mapped word */
        return CUDA_ERROR_INVALID_VALUE;
    __atomic_store_n((uint64_t *)(uintptr_t)addr, value, __ATOMIC_RELEASE);
    return CUDA_SUCCESS;
}

CUresult cuStreamWriteValue64_v2(CUstream s, CUdeviceptr a, uint64_t v, unsigned int f) { return write64(s, a, v, f); }
CUresult cuStreamWriteValue64(CUstream s, CUdeviceptr a, uint64_t v, unsigned int f) { return write64(s, a, v, f); }

static CUresult
wait64(CUstream stream, CUdeviceptr addr, uint64_t value, unsigned int flags)
{
    memop64_fn fw = FORWARD(FAKECUDA_WAIT64, memop64_fn);
    COUNT(FAKECUDA_WAIT64);
    if (fw)
        return fw(stream, addr, value, flags);
    if (addr == 0 || addr % 8 != 0)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;                        /* the Python fake's waits are satisfied at once */
}

CUresult cuStreamWaitValue64_v2(CUstream s, CUdeviceptr a, uint64_t v, unsigned int f) { return wait64(s, a, v, f); }
CUresult cuStreamWaitValue64(CUstream s, CUdeviceptr a, uint64_t v, unsigned int f) { return wait64(s, a, v, f); }

CUresult
cuStreamWaitEvent(CUstream stream, CUevent event, unsigned int flags)
{
    wait_event_fn fw = FORWARD(FAKECUDA_WAIT_EVENT, wait_event_fn);
    COUNT(FAKECUDA_WAIT_EVENT);
    if (fw)
        return fw(stream, event, flags);
    return CUDA_SUCCESS;
}

CUresult
cuEventRecord(CUevent event, CUstream stream)
{
    record_fn fw = FORWARD(FAKECUDA_RECORD, record_fn);
    COUNT(FAKECUDA_RECORD);
    if (fw)
        return fw(event, stream);
    return CUDA_SUCCESS;
}

CUresult
cuEventQuery(CUevent event)
{
    query_fn fw = FORWARD(FAKECUDA_QUERY, query_fn);
    COUNT(FAKECUDA_QUERY);
    if (fw)
        return fw(event);
    return CUDA_SUCCESS;                        /* everything recorded has completed */
}

CUresult
cuLaunchHostFunc(CUstream stream, CUhostFn fn, void *data)
{
    host_func_fn fw = FORWARD(FAKECUDA_HOST_FUNC, host_func_fn);
    COUNT(FAKECUDA_HOST_FUNC);
    if (fw)
        return fw(stream, fn, data);
    if (fn == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    fn(data);                                   /* at once, on the calling thread */
    return CUDA_SUCCESS;
}
