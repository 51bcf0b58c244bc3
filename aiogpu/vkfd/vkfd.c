/* vkfd.c - a virtual KFD: the thunk ABI (libhsakmt.so.1, symbol version HSAKMT_1) as ROCr 5.2.3
 * imports it, over emulated gfx90a GPUs, so that the unmodified ROCr library runs on a machine
 * without /dev/kfd.
 *
 * Devices: node 0 is the CPU, nodes 1..N the GPUs, every GPU linked to the CPU and to every other
 * GPU. Each GPU has one engine thread (its command processor and SDMA engines together) that
 * walks the device's queues with back-off when idle: AQL rings (dispatch, barrier-AND/OR,
 * vendor-specific) and SDMA rings (the packets ROCr's BlitSdmaV4 writes). Dispatches of ROCr's
 * own blit kernels are done there; every other dispatch goes to one of the device's compute-unit
 * threads, which calls the dispatch callback (aiogpu runs the kernel's NumPy body there) while
 * the engine goes on with the device's other queues. Completion as the CP does it: header back to INVALID,
 * read index past the packet, then the completion signal (amd_signal_t: value decremented, then
 * the event id into the event's mailbox and the KFD event raised).
 *
 * The control API (vkfd_*) is for aiogpu through ctypes: configuration before the first
 * hsaKmtOpenKFD, the dispatch callback, fault injection and per-GPU counters.
 */
#define _GNU_SOURCE
#include <hsakmt.h>
#include <dlfcn.h>
#include <elf.h>
#include <errno.h>
#include <link.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

/* ------------------------------------------------------------------ configuration */
#define MAX_GPUS 8
#define MAX_NODES (MAX_GPUS + 1)
#define CPU_NODE 0
#define SDMA_ENGINES 2
#define SDMA_QUEUES_PER_ENGINE 8
#define MAX_QUEUES 256            /* per process (KFD: KFD_MAX_NUM_OF_QUEUES_PER_PROCESS is 1024) */
#define MAX_EVENTS 4096           /* KFD_SIGNAL_EVENT_LIMIT: slots of the events page */
#define LDS_APERTURE 0x1000000000000ULL
#define SCRATCH_APERTURE 0x2000000000000ULL
#define VRAM_SIZE (16ULL << 30)
#define SYSMEM_SIZE (64ULL << 30)
/* registered (userptr) memory gets its own GPU address, as libhsakmt gives it on a discrete GPU
 * (hsaKmtMapMemoryToGPU's alternate VA, which ROCr hands back as hsa_amd_memory_lock's agent
 * pointer): bit 47, never a user-space host address. */
#define USERPTR_DELTA 0x800000000000ULL

static int g_gpus = 1;
static int g_sdma_limit[MAX_NODES];    /* SDMA queues granted per GPU before refusal */
static atomic_int g_eager;
static int g_open;                     /* hsaKmtOpenKFD count */
static atomic_int g_generation;        /* how often the KFD was opened from closed */
static pthread_mutex_t g_cfg_lock = PTHREAD_MUTEX_INITIALIZER;

#define IS_GPU(n) ((n) >= 1 && (n) <= (HSAuint32)g_gpus)

/* ------------------------------------------------------------------ counters */
enum { C_AQL_DISPATCH, C_AQL_BARRIER_AND, C_AQL_BARRIER_OR, C_AQL_VENDOR, C_SDMA_COPY_LINEAR, C_SDMA_BYTES,
       C_SDMA_FENCE, C_SDMA_TRAP, C_SDMA_POLL, C_SDMA_ATOMIC, C_SDMA_CONST_FILL, C_SDMA_TIMESTAMP, C_SDMA_NOP,
       C_BLIT_COPY, C_BLIT_FILL, C_INTERRUPTS, C_LOST_INTERRUPTS, C_QUEUE_ERRORS, C_MEMORY_FAULTS,
       C_SDMA_QUEUES, C_SDMA_REFUSED, C_AQL_QUEUES, C_DOORBELL_AHEAD, C_DOORBELL_BACKWARDS,
       C_SIGNAL_REARMED_EARLY, C_COUNT };
static const char *const COUNTER_NAMES[C_COUNT] = {
  "aql_dispatch", "aql_barrier_and", "aql_barrier_or", "aql_vendor", "sdma_copy_linear", "sdma_bytes",
  "sdma_fence", "sdma_trap", "sdma_poll", "sdma_atomic", "sdma_const_fill", "sdma_timestamp", "sdma_nop",
  "blit_copy", "blit_fill", "interrupts", "lost_interrupts", "queue_errors", "memory_faults",
  "sdma_queues", "sdma_queues_refused", "aql_queues", "doorbell_ahead", "doorbell_backwards",
  "signal_rearmed_early"};
static _Atomic uint64_t g_counters[MAX_NODES][C_COUNT];
#define COUNT(node, c, n) atomic_fetch_add(&g_counters[(node) < MAX_NODES ? (node) : 0][c], (n))

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static void warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void warn(const char *fmt, ...) {
  if (getenv("VKFD_QUIET")) return;
  va_list ap;
  va_start(ap, fmt);
  fputs("[vkfd] ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
}

/* ------------------------------------------------------------------ topology */
static void name16(HSAuint16 *dst, const char *s) {
  for (int i = 0; i < HSA_PUBLIC_NAME_SIZE - 1 && s[i]; i++) dst[i] = (HSAuint16)s[i];
}

EXPORT HSAKMT_STATUS hsaKmtOpenKFD(void);
EXPORT HSAKMT_STATUS hsaKmtCloseKFD(void);

EXPORT HSAKMT_STATUS hsaKmtGetVersion(HsaVersionInfo *v) {
  /* ROCr needs >= 0.99; exactly 1.0 turns interrupt signals off (amd_topology.cpp). */
  v->KernelInterfaceMajorVersion = 1;
  v->KernelInterfaceMinorVersion = 8;
  return HSAKMT_STATUS_SUCCESS;
}

static struct r_debug *g_rdebug;   /* ROCr's _amdgpu_r_debug: the link map of loaded code objects */
EXPORT HSAKMT_STATUS hsaKmtRuntimeEnable(void *rDebug, bool setupTtmp) {
  (void)setupTtmp;
  g_rdebug = rDebug;
  return HSAKMT_STATUS_NOT_SUPPORTED;   /* ROCr then leaves its exception-debugging path off */
}
EXPORT HSAKMT_STATUS hsaKmtRuntimeDisable(void) { return HSAKMT_STATUS_SUCCESS; }

EXPORT HSAKMT_STATUS hsaKmtAcquireSystemProperties(HsaSystemProperties *s) {
  memset(s, 0, sizeof(*s));
  s->NumNodes = 1 + g_gpus;
  return HSAKMT_STATUS_SUCCESS;
}
EXPORT HSAKMT_STATUS hsaKmtReleaseSystemProperties(void) { return HSAKMT_STATUS_SUCCESS; }

EXPORT HSAKMT_STATUS hsaKmtGetNodeProperties(HSAuint32 n, HsaNodeProperties *p) {
  if (n > (HSAuint32)g_gpus) return HSAKMT_STATUS_INVALID_NODE_UNIT;
  memset(p, 0, sizeof(*p));
  p->NumIOLinks = g_gpus;              /* the CPU to every GPU; a GPU to the CPU and its peers */
  if (n == CPU_NODE) {
    p->NumCPUCores = 16;
    p->NumMemoryBanks = 1;
    p->MaxEngineClockMhzCCompute = 3000;
    name16(p->MarketingName, "aiogpu virtual CPU");
    return HSAKMT_STATUS_SUCCESS;
  }
  /* gfx90a with 104 CUs. ROCr divides by NumSIMDPerCU, needs EngineId in its ISA registry,
   * DoorbellType 2 (64-bit AQL doorbells), and NumGws 0 keeps it from asking for a GWS queue. */
  p->NumFComputeCores = 104 * 4;
  p->NumMemoryBanks = 3;
  p->NumCaches = 2;
  p->FComputeIdLo = 0x80000000u + (n - 1) * 0x1000u;
  p->Capability.ui32.DoorbellType = 2;
  p->Capability.ui32.QueueSizePowerOfTwo = 1;
  p->MaxWavesPerSIMD = 8;
  p->LDSSizeInKB = 64;
  p->WaveFrontSize = 64;
  p->NumShaderBanks = 8;
  p->NumArrays = 1;
  p->NumCUPerArray = 13;
  p->NumSIMDPerCU = 4;
  p->MaxSlotsScratchCU = 32;
  p->EngineId.ui32.Major = 9;
  p->EngineId.ui32.Minor = 0;
  p->EngineId.ui32.Stepping = 10;
  p->VendorId = 0x1002;
  p->DeviceId = 0x740f;
  p->LocationId = 0x0300 + (n - 1) * 0x100;
  p->LocalMemSize = VRAM_SIZE;
  p->MaxEngineClockMhzFCompute = 1700;
  p->MaxEngineClockMhzCCompute = 3000;
  p->DrmRenderMinor = 128 + (n - 1);
  name16(p->MarketingName, "aiogpu virtual gfx90a");
  strncpy((char *)p->AMDName, "gfx90a", HSA_PUBLIC_NAME_SIZE - 1);
  p->uCodeEngineVersions.uCodeSDMA = 100;
  p->NumSdmaEngines = SDMA_ENGINES;
  p->NumSdmaXgmiEngines = 0;
  p->NumSdmaQueuesPerEngine = SDMA_QUEUES_PER_ENGINE;
  p->NumCpQueues = 24;
  p->NumGws = 0;
  p->UniqueID = 0xA10C0DE000ULL + n;
  p->VGPRSizePerCU = 512 * 1024;
  p->SGPRSizePerCU = 800 * 4 * 8;
  return HSAKMT_STATUS_SUCCESS;
}

EXPORT HSAKMT_STATUS hsaKmtGetNodeMemoryProperties(HSAuint32 n, HSAuint32 nb, HsaMemoryProperties *m) {
  if (n > (HSAuint32)g_gpus) return HSAKMT_STATUS_INVALID_NODE_UNIT;
  memset(m, 0, sizeof(*m) * nb);
  if (n == CPU_NODE) {
    if (nb >= 1) { m[0].HeapType = HSA_HEAPTYPE_SYSTEM; m[0].SizeInBytes = SYSMEM_SIZE; m[0].Width = 64; }
    return HSAKMT_STATUS_SUCCESS;
  }
  /* ROCr asserts a nonzero LDS aperture at queue creation; InitScratchPool maps the scratch one. */
  if (nb >= 1) { m[0].HeapType = HSA_HEAPTYPE_FRAME_BUFFER_PUBLIC; m[0].SizeInBytes = VRAM_SIZE; m[0].Width = 4096; }
  if (nb >= 2) { m[1].HeapType = HSA_HEAPTYPE_GPU_LDS; m[1].SizeInBytes = 64 << 10; m[1].VirtualBaseAddress = LDS_APERTURE; }
  if (nb >= 3) { m[2].HeapType = HSA_HEAPTYPE_GPU_SCRATCH; m[2].SizeInBytes = 1ULL << 32; m[2].VirtualBaseAddress = SCRATCH_APERTURE; }
  return HSAKMT_STATUS_SUCCESS;
}

EXPORT HSAKMT_STATUS hsaKmtGetNodeCacheProperties(HSAuint32 n, HSAuint32 proc, HSAuint32 nc, HsaCacheProperties *c) {
  memset(c, 0, sizeof(*c) * nc);
  for (HSAuint32 i = 0; i < nc; i++) {
    c[i].ProcessorIdLow = proc;
    c[i].CacheLevel = i + 1;
    c[i].CacheSize = i == 0 ? 16 : 8192;
    c[i].CacheLineSize = 64;
    c[i].CacheType.ui32.Data = 1;
    c[i].CacheType.ui32.HSACU = IS_GPU(n);
    c[i].CacheType.ui32.CPU = n == CPU_NODE;
  }
  return HSAKMT_STATUS_SUCCESS;
}

EXPORT HSAKMT_STATUS hsaKmtGetNodeIoLinkProperties(HSAuint32 n, HSAuint32 nl, HsaIoLinkProperties *l) {
  /* ROCr's SDMA blit reads the 64-bit atomics flag of the GPU's link to the CPU. */
  memset(l, 0, sizeof(*l) * nl);
  HSAuint32 k = 0;
  for (HSAuint32 to = 0; to <= (HSAuint32)g_gpus && k < nl; to++) {
    if (to == n) continue;
    int peer = n != CPU_NODE && to != CPU_NODE;
    l[k].IoLinkType = HSA_IOLINKTYPE_PCIEXPRESS;
    l[k].VersionMajor = 4;
    l[k].NodeFrom = n;
    l[k].NodeTo = to;
    l[k].Weight = peer ? 40 : 20;
    l[k].MinimumLatency = 1;
    l[k].MaximumLatency = 10;
    l[k].MinimumBandwidth = 16000;
    l[k].MaximumBandwidth = 32000;
    k++;
  }
  return HSAKMT_STATUS_SUCCESS;
}

EXPORT HSAKMT_STATUS hsaKmtGetXNACKMode(HSAint32 *enable) { *enable = 0; return HSAKMT_STATUS_SUCCESS; }
EXPORT HSAKMT_STATUS hsaKmtSetXNACKMode(HSAint32 enable) { return enable ? HSAKMT_STATUS_NOT_SUPPORTED : HSAKMT_STATUS_SUCCESS; }

EXPORT HSAKMT_STATUS hsaKmtGetTileConfig(HSAuint32 n, HsaGpuTileConfig *cfg) {
  (void)n;
  cfg->GbAddrConfig = 0x2a114042;   /* a gfx90a-like GB_ADDR_CONFIG for ROCr's image addrlib */
  cfg->NumTileConfigs = 0;
  cfg->NumMacroTileConfigs = 0;
  cfg->NumBanks = 16;
  cfg->NumRanks = 1;
  return HSAKMT_STATUS_SUCCESS;
}

EXPORT HSAKMT_STATUS hsaKmtGetClockCounters(HSAuint32 n, HsaClockCounters *c) {
  (void)n;
  uint64_t t = now_ns();
  c->GPUClockCounter = t / 10;          /* a 100 MHz GPU timestamp domain */
  c->CPUClockCounter = t;
  c->SystemClockCounter = t;
  c->SystemClockFrequencyHz = 1000000000ULL;
  return HSAKMT_STATUS_SUCCESS;
}

static void kcache_forget(uint64_t base, uint64_t size);
static void kcache_set(uint64_t kobj, int kind);

/* ------------------------------------------------------------------ memory */
typedef struct alloc {
  struct alloc *next;
  char *base;              /* host address */
  uint64_t size;
  uint64_t gpu_va;         /* == base, or the alias of registered memory */
  HSAuint32 node;
  HsaMemFlags flags;
  int registered;
  int mapped;              /* map count */
  HSAuint32 nmapped;
  HSAuint32 mapped_nodes[MAX_NODES];
  void *userdata;
} alloc_t;

static pthread_mutex_t g_mem_lock = PTHREAD_MUTEX_INITIALIZER;
static alloc_t *g_allocs;

static alloc_t *find_host_locked(const void *p) {
  for (alloc_t *a = g_allocs; a; a = a->next)
    if ((const char *)p >= a->base && (const char *)p < a->base + a->size) return a;
  return NULL;
}
static alloc_t *find_gpu_locked(uint64_t va, uint64_t n) {
  alloc_t *best = NULL;   /* innermost: a registration inside an allocation */
  for (alloc_t *a = g_allocs; a; a = a->next)
    if (va >= a->gpu_va && va + n <= a->gpu_va + a->size && (!best || a->size < best->size)) best = a;
  return best;
}

/* The host address behind GPU address [va, va + n), or NULL where nothing holds all of it. */
static void *g2h(uint64_t va, uint64_t n) {
  if (!(va & USERPTR_DELTA)) return (void *)(uintptr_t)va;   /* allocations: the GPU VA is the host's */
  pthread_mutex_lock(&g_mem_lock);
  alloc_t *a = find_gpu_locked(va, n);
  void *h = a ? a->base + (va - a->gpu_va) : NULL;
  pthread_mutex_unlock(&g_mem_lock);
  return h;
}

/* Whether GPU `node` may access [va, va + n): one allocation or registration holds it and it is
 * mapped to the node, as the GPU's page tables would require. */
static int node_can_access(uint64_t va, uint64_t n, HSAuint32 node) {
  pthread_mutex_lock(&g_mem_lock);
  alloc_t *a = find_gpu_locked(va, n);
  int ok = 0;
  if (a && a->mapped)
    for (HSAuint32 i = 0; i < a->nmapped; i++) ok |= a->mapped_nodes[i] == node;
  pthread_mutex_unlock(&g_mem_lock);
  return ok;
}

static void *map_anon(uint64_t size, uint64_t align) {
  uint64_t len = size + align;
  char *raw = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return NULL;
  uintptr_t b = ((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1);
  if (b > (uintptr_t)raw) munmap(raw, b - (uintptr_t)raw);
  uintptr_t end = (uintptr_t)raw + len, bend = b + size;
  if (end > bend) munmap((void *)bend, end - bend);
  return (void *)b;
}

EXPORT HSAKMT_STATUS hsaKmtAllocMemory(HSAuint32 node, HSAuint64 size, HsaMemFlags f, void **addr) {
  if (node > (HSAuint32)g_gpus || !size) return HSAKMT_STATUS_INVALID_PARAMETER;
  size = (size + 4095) & ~4095ULL;
  char *b = map_anon(size, size >= (2u << 20) ? (2u << 20) : 4096);
  if (!b) return HSAKMT_STATUS_NO_MEMORY;
  alloc_t *a = calloc(1, sizeof(*a));
  if (!a) { munmap(b, size); return HSAKMT_STATUS_NO_MEMORY; }
  a->base = b; a->size = size; a->node = node; a->flags = f; a->gpu_va = (uintptr_t)b;
  pthread_mutex_lock(&g_mem_lock);
  a->next = g_allocs; g_allocs = a;
  pthread_mutex_unlock(&g_mem_lock);
  *addr = b;
  return HSAKMT_STATUS_SUCCESS;
}

EXPORT HSAKMT_STATUS hsaKmtFreeMemory(void *addr, HSAuint64 size) {
  (void)size;
  pthread_mutex_lock(&g_mem_lock);
  alloc_t **pp = &g_allocs;
  while (*pp && !((*pp)->base == addr && !(*pp)->registered)) pp = &(*pp)->next;
  alloc_t *a = *pp;
  if (a) *pp = a->next;
  pthread_mutex_unlock(&g_mem_lock);
  if (!a) return HSAKMT_STATUS_INVALID_PARAMETER;
  kcache_forget(a->gpu_va, a->size);
  munmap(a->base, a->size);
  free(a);
  return HSAKMT_STATUS_SUCCESS;
}

static HSAKMT_STATUS do_map(void *addr, HSAuint64 *alt, HSAuint64 nn, const HSAuint32 *nodes) {
  pthread_mutex_lock(&g_mem_lock);
  alloc_t *a = find_host_locked(addr);
  if (!a) { pthread_mutex_unlock(&g_mem_lock); return HSAKMT_STATUS_INVALID_PARAMETER; }
  a->mapped++;
  a->nmapped = 0;
  if (nodes) {
    for (HSAuint64 i = 0; i < nn && a->nmapped < MAX_NODES; i++) a->mapped_nodes[a->nmapped++] = nodes[i];
  } else {
    for (HSAuint32 g = 1; g <= (HSAuint32)g_gpus; g++) a->mapped_nodes[a->nmapped++] = g;
  }
  if (alt) *alt = a->gpu_va + (uint64_t)((char *)addr - a->base);
  pthread_mutex_unlock(&g_mem_lock);
  return HSAKMT_STATUS_SUCCESS;
}

EXPORT HSAKMT_STATUS hsaKmtMapMemoryToGPU(void *addr, HSAuint64 size, HSAuint64 *alt) {
  (void)size;
  return do_map(addr, alt, 0, NULL);
}
EXPORT HSAKMT_STATUS hsaKmtMapMemoryToGPUNodes(void *addr, HSAuint64 size, HSAuint64 *alt, HsaMemMapFlags f,
                                               HSAuint64 nn, HSAuint32 *nodes) {
  (void)size; (void)f;
  return do_map(addr, alt, nn, nodes);
}
EXPORT HSAKMT_STATUS hsaKmtUnmapMemoryToGPU(void *addr) {
  pthread_mutex_lock(&g_mem_lock);
  alloc_t *a = find_host_locked(addr);
  if (a && a->mapped && !--a->mapped) a->nmapped = 0;
  pthread_mutex_unlock(&g_mem_lock);
  return HSAKMT_STATUS_SUCCESS;
}

EXPORT HSAKMT_STATUS hsaKmtRegisterMemoryWithFlags(void *addr, HSAuint64 size, HsaMemFlags f) {
  alloc_t *a = calloc(1, sizeof(*a));
  if (!a) return HSAKMT_STATUS_NO_MEMORY;
  a->base = addr; a->size = size; a->node = CPU_NODE; a->flags = f; a->registered = 1;
  a->gpu_va = (uintptr_t)addr | USERPTR_DELTA;
  pthread_mutex_lock(&g_mem_lock);
  a->next = g_allocs; g_allocs = a;
  pthread_mutex_unlock(&g_mem_lock);
  return HSAKMT_STATUS_SUCCESS;
}
EXPORT HSAKMT_STATUS hsaKmtDeregisterMemory(void *addr) {
  pthread_mutex_lock(&g_mem_lock);
  alloc_t **pp = &g_allocs;
  while (*pp && !((*pp)->base == addr && (*pp)->registered)) pp = &(*pp)->next;
  alloc_t *a = *pp;
  if (a) *pp = a->next;
  pthread_mutex_unlock(&g_mem_lock);
  free(a);
  return a ? HSAKMT_STATUS_SUCCESS : HSAKMT_STATUS_MEMORY_NOT_REGISTERED;
}

EXPORT HSAKMT_STATUS hsaKmtQueryPointerInfo(const void *p, HsaPointerInfo *info) {
  memset(info, 0, sizeof(*info));
  pthread_mutex_lock(&g_mem_lock);
  alloc_t *a = find_host_locked(p);
  if (!a) { pthread_mutex_unlock(&g_mem_lock); info->Type = HSA_POINTER_UNKNOWN; return HSAKMT_STATUS_ERROR; }
  info->Type = a->registered ? HSA_POINTER_REGISTERED_USER : HSA_POINTER_ALLOCATED;
  info->Node = a->node;
  info->MemFlags = a->flags;
  info->CPUAddress = a->base;
  info->GPUAddress = a->gpu_va;
  info->SizeInBytes = a->size;
  info->NMappedNodes = a->mapped ? a->nmapped : 0;
  info->MappedNodes = a->mapped_nodes;
  info->NRegisteredNodes = a->registered ? 1 : 0;
  info->RegisteredNodes = a->mapped_nodes;
  info->UserData = a->userdata;
  pthread_mutex_unlock(&g_mem_lock);
  return HSAKMT_STATUS_SUCCESS;
}
EXPORT HSAKMT_STATUS hsaKmtSetMemoryUserData(const void *p, void *ud) {
  pthread_mutex_lock(&g_mem_lock);
  alloc_t *a = find_host_locked(p);
  if (a) a->userdata = ud;
  pthread_mutex_unlock(&g_mem_lock);
  return a ? HSAKMT_STATUS_SUCCESS : HSAKMT_STATUS_INVALID_PARAMETER;
}
EXPORT HSAKMT_STATUS hsaKmtSetMemoryPolicy(HSAuint32 n, HSAuint32 d, HSAuint32 alt, void *a, HSAuint64 s) {
  (void)n; (void)d; (void)alt; (void)a; (void)s;
  return HSAKMT_STATUS_SUCCESS;
}

/* Not modelled (one process, no graphics interop, no SVM): ROCr treats NOT_SUPPORTED as absent. */
EXPORT HSAKMT_STATUS hsaKmtShareMemory(void *a, HSAuint64 s, HsaSharedMemoryHandle *h) { (void)a; (void)s; (void)h; return HSAKMT_STATUS_NOT_SUPPORTED; }
EXPORT HSAKMT_STATUS hsaKmtRegisterSharedHandle(const HsaSharedMemoryHandle *h, void **a, HSAuint64 *s) { (void)h; (void)a; (void)s; return HSAKMT_STATUS_NOT_SUPPORTED; }
EXPORT HSAKMT_STATUS hsaKmtRegisterSharedHandleToNodes(const HsaSharedMemoryHandle *h, void **a, HSAuint64 *s, HSAuint64 nn, HSAuint32 *nodes) { (void)h; (void)a; (void)s; (void)nn; (void)nodes; return HSAKMT_STATUS_NOT_SUPPORTED; }
EXPORT HSAKMT_STATUS hsaKmtRegisterGraphicsHandleToNodes(HSAuint64 gh, HsaGraphicsResourceInfo *gi, HSAuint64 nn, HSAuint32 *nodes) { (void)gh; (void)gi; (void)nn; (void)nodes; return HSAKMT_STATUS_NOT_SUPPORTED; }
EXPORT HSAKMT_STATUS hsaKmtSVMSetAttr(void *a, HSAuint64 s, unsigned int n, HSA_SVM_ATTRIBUTE *at) { (void)a; (void)s; (void)n; (void)at; return HSAKMT_STATUS_NOT_SUPPORTED; }
EXPORT HSAKMT_STATUS hsaKmtSVMGetAttr(void *a, HSAuint64 s, unsigned int n, HSA_SVM_ATTRIBUTE *at) { (void)a; (void)s; (void)n; (void)at; return HSAKMT_STATUS_NOT_SUPPORTED; }
EXPORT HSAKMT_STATUS hsaKmtSetTrapHandler(HSAuint32 n, void *base, HSAuint64 size, void *buf, HSAuint64 bufsize) {
  (void)n; (void)base; (void)size; (void)buf; (void)bufsize;
  return HSAKMT_STATUS_SUCCESS;
}

/* ------------------------------------------------------------------ events */
/* KFD's semantics (kfd_events.c): setting an auto-reset event that has waiters activates every
 * one of them and leaves the event unsignaled; without waiters the event stays signaled, and
 * the next wait consumes that (init_event_waiter_get_status). A flag that the first waiter
 * resets would lose the wake-up of a second thread waiting on the same event. */
typedef struct waiter {
  struct waiter *next;
  struct fevent *ev;
  int activated;
} waiter_t;

typedef struct fevent {
  HsaEvent ev;            /* first: ROCr holds HsaEvent* */
  int manual;
  int signaled;
  waiter_t *waiters;
} fevent_t;

static pthread_mutex_t g_ev_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_ev_cond;
static fevent_t *g_events[MAX_EVENTS];
static uint64_t *g_event_page;   /* the mailbox of signal event i is slot i (KFD's events page) */
static uint32_t g_next_event = 1;

static void ev_init_once(void) {
  pthread_condattr_t a;
  pthread_condattr_init(&a);
  pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
  pthread_cond_init(&g_ev_cond, &a);
}
static void ev_init(void) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, ev_init_once);
}

EXPORT HSAKMT_STATUS hsaKmtCreateEvent(HsaEventDescriptor *d, bool manual, bool signaled, HsaEvent **out) {
  ev_init();
  pthread_mutex_lock(&g_ev_lock);
  if (!g_event_page) {
    void *p;
    if (hsaKmtAllocMemory(CPU_NODE, MAX_EVENTS * 8, (HsaMemFlags){.Value = 0}, &p) != HSAKMT_STATUS_SUCCESS) {
      pthread_mutex_unlock(&g_ev_lock);
      return HSAKMT_STATUS_NO_MEMORY;
    }
    do_map(p, NULL, 0, NULL);
    g_event_page = p;
  }
  uint32_t id = 0;
  for (uint32_t i = 0; i < MAX_EVENTS && !id; i++) {
    uint32_t c = (g_next_event + i) % MAX_EVENTS;
    if (c && !g_events[c]) id = c;
  }
  if (!id) { pthread_mutex_unlock(&g_ev_lock); return HSAKMT_STATUS_OUT_OF_RESOURCES; }
  g_next_event = id + 1;
  fevent_t *e = calloc(1, sizeof(*e));
  if (!e) { pthread_mutex_unlock(&g_ev_lock); return HSAKMT_STATUS_NO_MEMORY; }
  e->ev.EventId = id;
  e->ev.EventData.EventType = d->EventType;
  e->ev.EventData.HWData1 = id;
  e->ev.EventData.HWData2 = d->EventType == HSA_EVENTTYPE_SIGNAL ? (HSAuint64)(uintptr_t)&g_event_page[id] : 0;
  e->ev.EventData.HWData3 = id;
  e->manual = manual;
  e->signaled = signaled;
  g_events[id] = e;
  pthread_mutex_unlock(&g_ev_lock);
  *out = &e->ev;
  return HSAKMT_STATUS_SUCCESS;
}

EXPORT HSAKMT_STATUS hsaKmtDestroyEvent(HsaEvent *ev) {
  if (!ev) return HSAKMT_STATUS_INVALID_HANDLE;
  fevent_t *e = (fevent_t *)ev;
  pthread_mutex_lock(&g_ev_lock);
  if (ev->EventId < MAX_EVENTS && g_events[ev->EventId] == e) g_events[ev->EventId] = NULL;
  for (waiter_t *w = e->waiters; w; w = w->next) { w->ev = NULL; w->activated = 1; }   /* KFD wakes them */
  pthread_cond_broadcast(&g_ev_cond);
  pthread_mutex_unlock(&g_ev_lock);
  free(e);
  return HSAKMT_STATUS_SUCCESS;
}

/* Under g_ev_lock. */
static void set_locked(fevent_t *e) {
  if (e->waiters) {
    for (waiter_t *w = e->waiters; w; w = w->next) w->activated = 1;
    e->signaled = e->manual;
  } else {
    e->signaled = 1;
  }
  pthread_cond_broadcast(&g_ev_cond);
}

EXPORT HSAKMT_STATUS hsaKmtSetEvent(HsaEvent *ev) {
  ev_init();
  pthread_mutex_lock(&g_ev_lock);
  set_locked((fevent_t *)ev);
  pthread_mutex_unlock(&g_ev_lock);
  return HSAKMT_STATUS_SUCCESS;
}

static void raise_event(uint32_t id) {
  pthread_mutex_lock(&g_ev_lock);
  if (id < MAX_EVENTS && g_events[id]) set_locked(g_events[id]);
  pthread_mutex_unlock(&g_ev_lock);
}

EXPORT HSAKMT_STATUS hsaKmtWaitOnMultipleEvents(HsaEvent *evs[], HSAuint32 n, bool all, HSAuint32 ms) {
  if (!evs || !n) return HSAKMT_STATUS_INVALID_PARAMETER;
  ev_init();
  struct timespec dl;
  clock_gettime(CLOCK_MONOTONIC, &dl);
  dl.tv_sec += ms / 1000;
  dl.tv_nsec += (long)(ms % 1000) * 1000000L;
  if (dl.tv_nsec >= 1000000000L) { dl.tv_sec++; dl.tv_nsec -= 1000000000L; }
  waiter_t local[8], *ws = n <= 8 ? local : calloc(n, sizeof(waiter_t));
  if (!ws) return HSAKMT_STATUS_NO_MEMORY;
  HSAKMT_STATUS status = HSAKMT_STATUS_WAIT_TIMEOUT;
  pthread_mutex_lock(&g_ev_lock);
  for (HSAuint32 i = 0; i < n; i++) {       /* init_event_waiter_get_status */
    fevent_t *e = (fevent_t *)evs[i];
    ws[i].ev = e;
    ws[i].activated = e->signaled;
    if (e->signaled && !e->manual) e->signaled = 0;
    ws[i].next = e->waiters;
    e->waiters = &ws[i];
  }
  for (;;) {
    HSAuint32 hit = 0;
    for (HSAuint32 i = 0; i < n; i++) hit += ws[i].activated != 0;
    if ((all && hit == n) || (!all && hit)) { status = HSAKMT_STATUS_SUCCESS; break; }
    if (ms == 0) break;
    int rc = ms == HSA_EVENTTIMEOUT_INFINITE ? pthread_cond_wait(&g_ev_cond, &g_ev_lock)
                                             : pthread_cond_timedwait(&g_ev_cond, &g_ev_lock, &dl);
    if (rc == ETIMEDOUT) break;
  }
  for (HSAuint32 i = 0; i < n; i++) {       /* unlink (events destroyed meanwhile cleared ev) */
    fevent_t *e = ws[i].ev;
    if (!e) continue;
    for (waiter_t **pp = &e->waiters; *pp; pp = &(*pp)->next)
      if (*pp == &ws[i]) { *pp = ws[i].next; break; }
  }
  pthread_mutex_unlock(&g_ev_lock);
  if (ws != local) free(ws);
  return status;
}

EXPORT HSAKMT_STATUS hsaKmtWaitOnEvent(HsaEvent *ev, HSAuint32 ms) { return hsaKmtWaitOnMultipleEvents(&ev, 1, true, ms); }

/* ------------------------------------------------------------------ signals (amd_signal_t) */
/* amd_hsa_signal.h: kind @0, value @8, event_mailbox_ptr @16, event_id @24 */
typedef struct {
  int64_t kind;
  _Atomic int64_t value;
  uint64_t event_mailbox_ptr;
  uint32_t event_id;
} vsignal_t;

static _Atomic int64_t g_drop_interrupts[MAX_NODES];   /* injected: interrupts lost */

/* What the CP's end-of-pipe does with a completion signal: decrement, then the interrupt. */
static void signal_complete(HSAuint32 node, uint64_t handle) {
  if (!handle) return;
  vsignal_t *s = (vsignal_t *)(uintptr_t)handle;
  atomic_fetch_sub(&s->value, 1);
  if (!s->event_mailbox_ptr) return;
  if (atomic_load(&g_drop_interrupts[node]) > 0 && atomic_fetch_sub(&g_drop_interrupts[node], 1) > 0) {
    COUNT(node, C_LOST_INTERRUPTS, 1);
    return;
  }
  __atomic_store_n((uint64_t *)(uintptr_t)s->event_mailbox_ptr, s->event_id, __ATOMIC_RELEASE);
  COUNT(node, C_INTERRUPTS, 1);
  raise_event(s->event_id);
}

/* ------------------------------------------------------------------ queues */
typedef struct vqueue {
  HSA_QUEUEID id;
  HSA_QUEUE_TYPE type;
  HSAuint32 node;
  char *ring;
  uint64_t ring_size;             /* bytes */
  volatile uint64_t *rptr;        /* AQL: amd_queue_t.read_dispatch_id (ROCr's memory); SDMA: ours */
  volatile uint64_t *wptr;
  volatile uint64_t *doorbell;    /* ours: ROCr stores the last packet index (AQL) or the wptr (SDMA) */
  atomic_int halted;              /* a queue error or an eviction stopped it */
  atomic_int busy;                /* a dispatch of this queue is on a compute unit */
  atomic_int refs;                /* the queue table's and a running dispatch's */
  int destroyed;                  /* under mu: ROCr destroyed it; its memory is gone */
  pthread_mutex_t mu;
  uint64_t *ctl;                  /* our page: doorbell, SDMA rptr and wptr */
  /* The writer's protocol as the engine observes it (AQL; engine thread only): */
  uint64_t last_db;               /* the doorbell value last read (UINT64_MAX: never rung) */
  uint64_t seen;                  /* packets [0, seen) were seen published (valid header) */
  uint64_t fetch_idx;             /* the packet at the read index when first seen published */
  int64_t fetch_armed;            /* its completion signal's value then */
} vqueue_t;

/* A user dispatch handed to a compute unit: the queue waits for it (packets of one queue run in
 * order, which the barrier bit asks at most), other queues of the device go on. */
typedef struct job {
  struct job *next;
  vqueue_t *q;
  uint8_t *pkt;
  uint64_t r, completion, kobj, karg;
  uint32_t grid[3];
  uint16_t wg[3];
  uint32_t dims, group, priv;
  int64_t armed;                  /* the completion signal's value when the packet was fetched */
} job_t;
#define COMPUTE_UNITS 4

typedef struct vdev {
  pthread_t thread;
  atomic_int stop;
  int running;
  pthread_mutex_t lock;           /* the queue list; held while a queue steps */
  vqueue_t *queues[MAX_QUEUES];
  int nqueues;
  int sdma_queues;
  atomic_int evicted;             /* KFD: after a VM fault the process stays evicted here */
  _Atomic uint64_t pending_queue_error;
  atomic_int pending_memory_fault;
  pthread_mutex_t job_lock;
  pthread_cond_t job_cond;
  job_t *jobs, **jobs_tail;
  pthread_t cu[COMPUTE_UNITS];
  int ncu;
} vdev_t;

static vdev_t g_dev[MAX_NODES];
static pthread_mutex_t g_q_lock = PTHREAD_MUTEX_INITIALIZER;
static vqueue_t *g_queues[MAX_QUEUES];   /* by id - 1 */

#define AQL_VENDOR 0
#define AQL_INVALID 1
#define AQL_DISPATCH 2
#define AQL_BARRIER_AND 3
#define AQL_AGENT_DISPATCH 4
#define AQL_BARRIER_OR 5

/* amd_hsa_queue.h: amd_queue_t.write_dispatch_id @56, queue_inactive_signal @192 */
#define AMD_QUEUE_WRITE_DISPATCH_ID 56
#define AMD_QUEUE_INACTIVE_SIGNAL 192

static void vm_fault(HSAuint32 node, uint64_t addr);

/* The CP stops the queue and writes the error code to amd_queue_t.queue_inactive_signal, whose
 * handler in ROCr (AqlQueue::DynamicScratchHandler) maps the bits to a status for the queue's
 * error callback: 2 invalid dim, 8 invalid code object, 0x80000000 a trap (ERROR_EXCEPTION). */
static void queue_error(vqueue_t *q, uint64_t code) {
  atomic_store(&q->halted, 1);
  COUNT(q->node, C_QUEUE_ERRORS, 1);
  char *amdq = (char *)q->wptr - AMD_QUEUE_WRITE_DISPATCH_ID;
  uint64_t h = *(uint64_t *)(amdq + AMD_QUEUE_INACTIVE_SIGNAL);
  if (!h) return;
  vsignal_t *s = (vsignal_t *)(uintptr_t)h;
  atomic_store(&s->value, (int64_t)code);
  if (s->event_mailbox_ptr) {
    __atomic_store_n((uint64_t *)(uintptr_t)s->event_mailbox_ptr, s->event_id, __ATOMIC_RELEASE);
    COUNT(q->node, C_INTERRUPTS, 1);
    raise_event(s->event_id);
  }
}

/* ------------------------------------------------------------------ blit kernels */
/* ROCr 5.2.3's blit kernels (BlitKernel: CopyAligned, CopyMisaligned, Fill) are raw ISA behind
 * an amd_kernel_code_t that GpuAgent::AssembleShader builds, not code objects. Told apart at run
 * time: their machine code lies in the loaded libhsa-runtime64 image (no user code object does);
 * which of the three by the dispatch's geometry and kernel arguments, as
 * BlitKernel::SubmitLinearCopyCommand / SubmitLinearFillCommand write them. */
enum { K_UNKNOWN, K_USER, K_BLIT };
typedef struct { uint64_t kobj; int kind; } kcache_t;
#define KCACHE 256
static kcache_t g_kcache[KCACHE];
static pthread_mutex_t g_kc_lock = PTHREAD_MUTEX_INITIALIZER;

struct find_ctx { const void *needle; size_t n; int found; };
static int phdr_cb(struct dl_phdr_info *info, size_t size, void *data) {
  (void)size;
  struct find_ctx *c = data;
  if (!info->dlpi_name || !strstr(info->dlpi_name, "libhsa-runtime64")) return 0;
  for (int i = 0; i < info->dlpi_phnum && !c->found; i++) {
    const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
    if (ph->p_type != PT_LOAD || !(ph->p_flags & PF_R)) continue;
    const char *seg = (const char *)(info->dlpi_addr + ph->p_vaddr);
    if (memmem(seg, ph->p_filesz, c->needle, c->n)) c->found = 1;
  }
  return c->found;
}

static int kernel_kind(uint64_t kobj) {
  pthread_mutex_lock(&g_kc_lock);
  for (int i = 0; i < KCACHE; i++)
    if (g_kcache[i].kobj == kobj) { int k = g_kcache[i].kind; pthread_mutex_unlock(&g_kc_lock); return k; }
  pthread_mutex_unlock(&g_kc_lock);
  int kind = K_USER;
  /* amd_kernel_code_t and the v3+ kernel descriptor both hold the entry offset at byte 16 */
  if (g2h(kobj, 64)) {
    int64_t off = *(int64_t *)(uintptr_t)(kobj + 16);
    const void *isa = g2h(kobj + (uint64_t)off, 64);
    if (off > 0 && off < (1 << 20) && isa) {
      struct find_ctx c = {isa, 64, 0};
      dl_iterate_phdr(phdr_cb, &c);
      if (c.found) kind = K_BLIT;
    }
  }
  kcache_set(kobj, kind);
  return kind;
}

static void kcache_set(uint64_t kobj, int kind) {
  pthread_mutex_lock(&g_kc_lock);
  int slot = -1;
  for (int i = 0; i < KCACHE && slot < 0; i++) if (g_kcache[i].kobj == kobj) slot = i;
  for (int i = 0; i < KCACHE && slot < 0; i++) if (!g_kcache[i].kobj) slot = i;
  if (slot < 0) slot = (int)(kobj / 64 % KCACHE);
  g_kcache[slot].kobj = kobj;
  g_kcache[slot].kind = kind;
  pthread_mutex_unlock(&g_kc_lock);
}

/* Forget cached kernel objects in [base, base + size): freed code memory may hold other code. */
static void kcache_forget(uint64_t base, uint64_t size) {
  pthread_mutex_lock(&g_kc_lock);
  for (int i = 0; i < KCACHE; i++)
    if (g_kcache[i].kobj >= base && g_kcache[i].kobj < base + size) g_kcache[i].kobj = 0;
  pthread_mutex_unlock(&g_kc_lock);
}

static int blit_copy(vqueue_t *q, uint64_t src, uint64_t dst, uint64_t n) {
  if (!n) return 0;
  if (!node_can_access(src, n, q->node)) { vm_fault(q->node, src); return -1; }
  if (!node_can_access(dst, n, q->node)) { vm_fault(q->node, dst); return -1; }
  memmove(g2h(dst, n), g2h(src, n), n);
  return 0;
}

/* 0 done, -1 faulted, 1 not a form this model knows (a queue error) */
static int blit_run(vqueue_t *q, uint32_t grid_x, uint64_t karg) {
  const uint64_t *a = g2h(karg, 96);
  if (!a) { vm_fault(q->node, karg); return -1; }
  uint32_t cus = 104;                              /* NumFComputeCores / 4 */
  if (grid_x == 64 * cus) {                        /* Fill: dst start, phase-2 start, end, value */
    uint32_t v = *(const uint32_t *)(a + 3);
    uint64_t n = a[2] - a[0];
    if (a[2] < a[0] || !node_can_access(a[0], n, q->node)) { vm_fault(q->node, a[0]); return -1; }
    uint32_t *d = g2h(a[0], n);
    for (uint64_t i = 0; i < n / 4; i++) d[i] = v;
    COUNT(q->node, C_BLIT_FILL, 1);
    return 0;
  }
  if (grid_x != 64 * 4 * cus) return 1;
  const uint32_t *w = (const uint32_t *)a;
  if (w[20] == grid_x && a[8] >= a[0] && a[8] - a[0] == a[9] - a[1]) {   /* CopyAligned */
    if (blit_copy(q, a[0], a[1], a[8] - a[0])) return -1;
  } else if (w[12] == grid_x && a[4] >= a[0] && a[4] - a[0] == a[5] - a[1]) {   /* CopyMisaligned */
    if (blit_copy(q, a[0], a[1], a[4] - a[0])) return -1;
  } else {
    return 1;
  }
  COUNT(q->node, C_BLIT_COPY, 1);
  return 0;
}

/* ------------------------------------------------------------------ dispatch callback */
typedef int64_t (*dispatch_cb_t)(uint32_t gpu, uint64_t kernel_object, uint64_t kernarg, const uint32_t *grid,
                                 const uint16_t *workgroup, uint32_t dims, uint32_t group_segment,
                                 uint32_t private_segment);
static _Atomic(dispatch_cb_t) g_dispatch_cb;
static atomic_int g_cb_inflight;
static _Atomic uint64_t g_fault_addr;

/* ------------------------------------------------------------------ AQL command processor */
static int64_t sig_value(uint64_t h) { return atomic_load(&((vsignal_t *)(uintptr_t)h)->value); }

/* `armed`: the completion signal's value when the engine fetched the packet. A value that went
 * up since then was stored by the host while the packet was pending: the signal was re-armed
 * (reused) before this packet retired, and this decrement lands on the new use's count. */
static void retire(vqueue_t *q, uint8_t *pkt, uint64_t r, uint64_t completion, int64_t armed) {
  if (completion && sig_value(completion) > armed) COUNT(q->node, C_SIGNAL_REARMED_EARLY, 1);
  __atomic_store_n((uint16_t *)pkt, AQL_INVALID, __ATOMIC_RELEASE);
  __atomic_store_n(q->rptr, r + 1, __ATOMIC_RELEASE);   /* before the signal: its waiter reads it */
  signal_complete(q->node, completion);
}

/* What the CP sees of the doorbell: the writer stores the index of the last packet it published,
 * after that packet's header (the HSA writer protocol; ROCr's blit queue in
 * BlitKernel::ReleaseWriteIndex), so every packet up to that index has a valid header, or was
 * processed already, whenever the CP reads the value; and the value never decreases (the CP
 * takes it as its new write pointer). Checked each time the engine reads a new value, on every
 * AQL queue, ROCr's own included. */
static void doorbell_check(vqueue_t *q, uint64_t db) {
  if (db == UINT64_MAX || db == q->last_db) return;
  uint64_t prev = q->last_db;
  q->last_db = db;
  if (prev != UINT64_MAX && db < prev) { COUNT(q->node, C_DOORBELL_BACKWARDS, 1); return; }
  uint64_t slots = q->ring_size / 64, r = __atomic_load_n(q->rptr, __ATOMIC_ACQUIRE);
  /* past a full ring: that slot still holds an older packet, the named one cannot be published */
  if (db >= r + slots) { COUNT(q->node, C_DOORBELL_AHEAD, 1); return; }
  /* packets from `seen` on were never fetched, so none of them is being retired now */
  for (uint64_t i = q->seen > r ? q->seen : r; i <= db; i++) {
    uint16_t h = __atomic_load_n((uint16_t *)(q->ring + (i % slots) * 64), __ATOMIC_ACQUIRE);
    if ((h & 0xff) == AQL_INVALID) { COUNT(q->node, C_DOORBELL_AHEAD, 1); return; }
    q->seen = i + 1;
  }
}

/* One packet if it can go now; 1 if the queue moved. */
static int aql_step(vqueue_t *q) {
  uint64_t db = __atomic_load_n(q->doorbell, __ATOMIC_ACQUIRE);
  doorbell_check(q, db);
  uint64_t r = *q->rptr;
  if (!atomic_load(&g_eager) && (db == UINT64_MAX || r > db)) return 0;
  uint8_t *pkt = (uint8_t *)q->ring + (r % (q->ring_size / 64)) * 64;
  uint16_t header = __atomic_load_n((uint16_t *)pkt, __ATOMIC_ACQUIRE);
  int type = header & 0xff;
  if (type == AQL_INVALID) return 0;
  uint64_t completion = *(uint64_t *)(pkt + 56);
  if (q->fetch_idx != r) {   /* first seen published: the packet is fetched */
    q->fetch_idx = r;
    q->fetch_armed = completion ? sig_value(completion) : 0;
    if (q->seen < r + 1) q->seen = r + 1;
  }
  int64_t armed = q->fetch_armed;
  switch (type) {
    case AQL_BARRIER_AND:
    case AQL_BARRIER_OR: {
      const uint64_t *dep = (const uint64_t *)(pkt + 8);
      int n = 0, done = 0;
      for (int i = 0; i < 5; i++) if (dep[i]) { n++; done += sig_value(dep[i]) == 0; }
      if (type == AQL_BARRIER_AND ? done < n : (n && !done)) return 0;
      COUNT(q->node, type == AQL_BARRIER_AND ? C_AQL_BARRIER_AND : C_AQL_BARRIER_OR, 1);
      retire(q, pkt, r, completion, armed);
      return 1;
    }
    case AQL_VENDOR:   /* AMD_AQL_FORMAT_PM4_IB: ROCr's cache-invalidate IB; nothing to do here */
      COUNT(q->node, C_AQL_VENDOR, 1);
      retire(q, pkt, r, completion, armed);
      return 1;
    case AQL_DISPATCH: {
      uint64_t kobj = *(uint64_t *)(pkt + 32), karg = *(uint64_t *)(pkt + 40);
      uint32_t grid[3] = {*(uint32_t *)(pkt + 12), *(uint32_t *)(pkt + 16), *(uint32_t *)(pkt + 20)};
      uint16_t wg[3] = {*(uint16_t *)(pkt + 4), *(uint16_t *)(pkt + 6), *(uint16_t *)(pkt + 8)};
      uint32_t dims = *(uint16_t *)(pkt + 2) & 3;
      COUNT(q->node, C_AQL_DISPATCH, 1);
      uint64_t injected = atomic_exchange(&g_dev[q->node].pending_queue_error, 0);
      if (injected) { queue_error(q, injected); return 1; }
      if (atomic_exchange(&g_dev[q->node].pending_memory_fault, 0)) { vm_fault(q->node, karg); return 1; }
      if (!kobj) { queue_error(q, 8); return 1; }
      if (dims < 1 || dims > 3) { queue_error(q, 2); return 1; }
      if (karg && !node_can_access(karg, 16, q->node)) { vm_fault(q->node, karg); return 1; }
      if (kernel_kind(kobj) == K_BLIT) {
        int rc = blit_run(q, grid[0], karg);
        if (rc == 0) retire(q, pkt, r, completion, armed);
        if (rc <= 0) return 1;
        /* code like a blit kernel's but not dispatched as one: the callback decides */
      }
      job_t *j = calloc(1, sizeof(*j));
      if (!j) return 0;
      *j = (job_t){NULL, q, pkt, r, completion, kobj, karg, {grid[0], grid[1], grid[2]}, {wg[0], wg[1], wg[2]},
                   dims, *(uint32_t *)(pkt + 28), *(uint32_t *)(pkt + 24), armed};
      vdev_t *d = &g_dev[q->node];
      atomic_store(&q->busy, 1);
      atomic_fetch_add(&q->refs, 1);
      pthread_mutex_lock(&d->job_lock);
      *d->jobs_tail = j;
      d->jobs_tail = &j->next;
      pthread_cond_signal(&d->job_cond);
      pthread_mutex_unlock(&d->job_lock);
      return 1;
    }
    default:   /* agent dispatch and reserved types: the CP rejects the packet format */
      queue_error(q, 32);
      return 1;
  }
}

/* ------------------------------------------------------------------ SDMA engine */
/* The packets ROCr's BlitSdmaV4 (gfx9) writes: 64-bit monotonic ring indexes in bytes, counts
 * encoded as count - 1, the ring's tail padded with NOPs (zero dwords) before a wrap. */
#define SDMA_OP_NOP 0
#define SDMA_OP_COPY 1
#define SDMA_OP_FENCE 5
#define SDMA_OP_TRAP 6
#define SDMA_OP_POLL_REGMEM 8
#define SDMA_OP_ATOMIC 10
#define SDMA_OP_CONST_FILL 11
#define SDMA_OP_TIMESTAMP 13
#define SDMA_OP_GCR 17
#define SDMA_ATOMIC_ADD64 47

static uint32_t sdma_dwords(const uint32_t *p) {
  uint32_t op = p[0] & 0xff, sub = (p[0] >> 8) & 0xff;
  switch (op) {
    case SDMA_OP_NOP: return 1 + ((p[0] >> 16) & 0x3fff);
    case SDMA_OP_COPY: return sub == 0 ? 7 : 0;
    case SDMA_OP_FENCE: return 4;
    case SDMA_OP_TRAP: return 2;
    case SDMA_OP_POLL_REGMEM: return 6;
    case SDMA_OP_ATOMIC: return 8;
    case SDMA_OP_CONST_FILL: return 5;
    case SDMA_OP_TIMESTAMP: return 3;
    case SDMA_OP_GCR: return 5;
    default: return 0;
  }
}

static int poll_ok(uint32_t func, uint32_t v, uint32_t ref) {
  switch (func) {
    case 0: return 1;
    case 1: return v < ref;
    case 2: return v <= ref;
    case 3: return v == ref;
    case 4: return v != ref;
    case 5: return v >= ref;
    case 6: return v > ref;
    default: return 1;
  }
}

/* 1 done, 0 must wait (a poll not satisfied yet), -1 the engine stops (fault or bad packet) */
static int sdma_exec(vqueue_t *q, const uint32_t *p) {
  uint32_t op = p[0] & 0xff;
  HSAuint32 node = q->node;
  uint64_t a64 = p[1] | ((uint64_t)p[2] << 32);
  switch (op) {
    case SDMA_OP_NOP: COUNT(node, C_SDMA_NOP, 1); return 1;
    case SDMA_OP_COPY: {
      uint64_t n = (p[1] & 0x3fffff) + 1;
      uint64_t src = p[3] | ((uint64_t)p[4] << 32), dst = p[5] | ((uint64_t)p[6] << 32);
      if (!node_can_access(src, n, node)) { vm_fault(node, src); return -1; }
      if (!node_can_access(dst, n, node)) { vm_fault(node, dst); return -1; }
      memmove(g2h(dst, n), g2h(src, n), n);
      COUNT(node, C_SDMA_COPY_LINEAR, 1);
      COUNT(node, C_SDMA_BYTES, n);
      return 1;
    }
    case SDMA_OP_FENCE: {
      uint32_t *at = g2h(a64, 4);
      if (!at) { vm_fault(node, a64); return -1; }
      __atomic_store_n(at, p[3], __ATOMIC_RELEASE);
      COUNT(node, C_SDMA_FENCE, 1);
      return 1;
    }
    case SDMA_OP_TRAP: {
      uint32_t id = p[1] & 0xfffffff;
      COUNT(node, C_SDMA_TRAP, 1);
      if (atomic_load(&g_drop_interrupts[node]) > 0 && atomic_fetch_sub(&g_drop_interrupts[node], 1) > 0) {
        COUNT(node, C_LOST_INTERRUPTS, 1);
        return 1;
      }
      COUNT(node, C_INTERRUPTS, 1);
      raise_event(id);
      return 1;
    }
    case SDMA_OP_POLL_REGMEM: {
      uint32_t func = (p[0] >> 28) & 7, mem = (p[0] >> 31) & 1, hdp = (p[0] >> 26) & 1;
      if (hdp || !mem) { COUNT(node, C_SDMA_POLL, 1); return 1; }   /* an HDP flush: nothing to flush */
      uint32_t *at = g2h(a64, 4);
      if (!at) { vm_fault(node, a64); return -1; }
      if (!poll_ok(func, __atomic_load_n(at, __ATOMIC_ACQUIRE) & p[4], p[3])) return 0;
      COUNT(node, C_SDMA_POLL, 1);
      return 1;
    }
    case SDMA_OP_ATOMIC: {
      uint32_t opn = (p[0] >> 25) & 0x7f;
      _Atomic int64_t *at = g2h(a64, 8);
      if (!at) { vm_fault(node, a64); return -1; }
      if (opn != SDMA_ATOMIC_ADD64) { warn("SDMA atomic operation %u is not modelled", opn); return -1; }
      atomic_fetch_add(at, (int64_t)(p[3] | ((uint64_t)p[4] << 32)));
      COUNT(node, C_SDMA_ATOMIC, 1);
      return 1;
    }
    case SDMA_OP_CONST_FILL: {
      uint64_t n = (p[4] & 0x3fffff) + 1;
      if (!node_can_access(a64, n, node)) { vm_fault(node, a64); return -1; }
      uint32_t *d = g2h(a64, n);
      for (uint64_t i = 0; i < n / 4; i++) d[i] = p[3];
      COUNT(node, C_SDMA_CONST_FILL, 1);
      return 1;
    }
    case SDMA_OP_TIMESTAMP: {
      uint64_t *at = g2h(a64, 8);
      if (!at) { vm_fault(node, a64); return -1; }
      *at = now_ns() / 10;
      COUNT(node, C_SDMA_TIMESTAMP, 1);
      return 1;
    }
    case SDMA_OP_GCR: return 1;
    default:
      warn("SDMA queue %llu: unknown packet 0x%x: engine stopped", (unsigned long long)q->id, p[0]);
      return -1;
  }
}

static int sdma_step(vqueue_t *q) {
  uint64_t w = __atomic_load_n(q->doorbell, __ATOMIC_ACQUIRE);   /* ROCr stores the wptr there last */
  uint64_t r = *q->rptr;
  int moved = 0;
  for (int k = 0; k < 64 && r < w; k++) {
    const uint32_t *p = (const uint32_t *)(q->ring + (r % q->ring_size));
    uint32_t nd = sdma_dwords(p);
    if (!nd) { warn("SDMA queue %llu: bad packet 0x%x", (unsigned long long)q->id, p[0]); atomic_store(&q->halted, 1); break; }
    int rc = sdma_exec(q, p);
    if (rc == 0) break;
    if (rc < 0) { atomic_store(&q->halted, 1); break; }
    r += nd * 4;
    __atomic_store_n(q->rptr, r, __ATOMIC_RELEASE);
    moved = 1;
  }
  return moved;
}

/* ------------------------------------------------------------------ compute units */
static void queue_unref(vqueue_t *q) {
  if (atomic_fetch_sub(&q->refs, 1) == 1) {
    pthread_mutex_destroy(&q->mu);
    free(q);
  }
}

/* A dispatch of a queue destroyed meanwhile is dropped, as KFD's preemption of a destroyed queue
 * drops it: nothing is written to memory ROCr has freed. (A body already running finishes.) */
static void run_job(job_t *j) {
  vqueue_t *q = j->q;
  pthread_mutex_lock(&q->mu);
  int gone = q->destroyed;
  pthread_mutex_unlock(&q->mu);
  int64_t rc = 0;
  if (!gone) {
    atomic_fetch_add(&g_cb_inflight, 1);
    dispatch_cb_t cb = atomic_load(&g_dispatch_cb);
    rc = cb ? cb(q->node - 1, j->kobj, j->karg, j->grid, j->wg, j->dims, j->group, j->priv) : 8;
    atomic_fetch_sub(&g_cb_inflight, 1);
  }
  pthread_mutex_lock(&q->mu);
  if (!q->destroyed) {
    if (rc == 0) retire(q, j->pkt, j->r, j->completion, j->armed);
    else if (rc < 0) vm_fault(q->node, atomic_load(&g_fault_addr));
    else queue_error(q, (uint64_t)rc);
    atomic_store(&q->busy, 0);
  }
  pthread_mutex_unlock(&q->mu);
  queue_unref(q);
}

static void *compute_unit(void *arg) {
  vdev_t *d = arg;
  pthread_mutex_lock(&d->job_lock);
  for (;;) {
    while (!d->jobs) pthread_cond_wait(&d->job_cond, &d->job_lock);
    job_t *j = d->jobs;
    d->jobs = j->next;
    if (!d->jobs) d->jobs_tail = &d->jobs;
    pthread_mutex_unlock(&d->job_lock);
    run_job(j);
    free(j);
    pthread_mutex_lock(&d->job_lock);
  }
  pthread_mutex_unlock(&d->job_lock);
  return NULL;
}

/* ------------------------------------------------------------------ engine thread per GPU */
static void *engine(void *arg) {
  vdev_t *d = arg;
  unsigned idle = 0;
  while (!atomic_load(&d->stop)) {
    int moved = 0;
    if (atomic_load(&d->evicted)) { struct timespec ts = {0, 1000000}; nanosleep(&ts, NULL); continue; }
    pthread_mutex_lock(&d->lock);
    for (int i = 0; i < d->nqueues; i++) {
      vqueue_t *q = d->queues[i];
      if (atomic_load(&q->halted) || atomic_load(&q->busy)) continue;
      moved |= q->type == HSA_QUEUE_COMPUTE_AQL ? aql_step(q) : sdma_step(q);
    }
    pthread_mutex_unlock(&d->lock);
    if (moved) { idle = 0; continue; }
    /* back-off: spin briefly, then yield, then sleep longer the longer it stays idle */
    idle++;
    if (idle < 64) continue;
    if (idle < 256) { sched_yield(); continue; }
    struct timespec ts = {0, idle < 4096 ? 20000 : idle < 20000 ? 200000 : 1000000};
    nanosleep(&ts, NULL);
  }
  return NULL;
}

static void vm_fault(HSAuint32 node, uint64_t addr) {
  COUNT(node, C_MEMORY_FAULTS, 1);
  /* KFD (kfd_dqm_evict_pasid) evicts every queue of the process on the device, and queues
   * created later are created evicted while the process stays evicted there: the engine and
   * hsaKmtCreateQueue read the flag (no queue lock here: the engine may be the caller). */
  atomic_store(&g_dev[node].evicted, 1);
  pthread_mutex_lock(&g_ev_lock);
  for (int i = 0; i < MAX_EVENTS; i++) {
    fevent_t *e = g_events[i];
    if (e && e->ev.EventData.EventType == HSA_EVENTTYPE_MEMORY) {
      HsaMemoryAccessFault *f = &e->ev.EventData.EventData.MemoryAccessFault;
      memset(f, 0, sizeof(*f));
      f->NodeId = node;
      f->VirtualAddress = addr;
      f->Failure.NotPresent = 1;
      f->Flags = HSA_EVENTID_MEMORY_FATAL_PROCESS;
      set_locked(e);
    }
  }
  pthread_mutex_unlock(&g_ev_lock);
}

EXPORT HSAKMT_STATUS hsaKmtCreateQueue(HSAuint32 node, HSA_QUEUE_TYPE type, HSAuint32 pct, HSA_QUEUE_PRIORITY prio,
                                       void *addr, HSAuint64 size, HsaEvent *ev, HsaQueueResource *r) {
  (void)pct; (void)prio; (void)ev;
  if (!IS_GPU(node)) return HSAKMT_STATUS_INVALID_NODE_UNIT;
  int sdma = type == HSA_QUEUE_SDMA || type == HSA_QUEUE_SDMA_XGMI;
  if (!sdma && type != HSA_QUEUE_COMPUTE_AQL) return HSAKMT_STATUS_NOT_SUPPORTED;
  if (!addr || !size || (size & (size - 1))) return HSAKMT_STATUS_INVALID_PARAMETER;
  vdev_t *d = &g_dev[node];
  vqueue_t *q = calloc(1, sizeof(*q));
  void *ctl;
  if (!q) return HSAKMT_STATUS_NO_MEMORY;
  if (hsaKmtAllocMemory(CPU_NODE, 4096, (HsaMemFlags){.Value = 0}, &ctl) != HSAKMT_STATUS_SUCCESS) { free(q); return HSAKMT_STATUS_NO_MEMORY; }
  do_map(ctl, NULL, 0, NULL);
  pthread_mutex_lock(&g_q_lock);
  pthread_mutex_lock(&d->lock);
  int slot = -1;
  for (int i = 0; i < MAX_QUEUES && slot < 0; i++) if (!g_queues[i]) slot = i;
  /* KFD refuses SDMA queues beyond the engines' queue slots (here: the configured limit) and
   * the ioctl's failure is HSAKMT_STATUS_ERROR; ROCr then falls back to its blit kernels. */
  int refuse = slot < 0 || d->nqueues >= MAX_QUEUES || (sdma && d->sdma_queues >= g_sdma_limit[node]);
  if (refuse) {
    pthread_mutex_unlock(&d->lock);
    pthread_mutex_unlock(&g_q_lock);
    if (sdma) COUNT(node, C_SDMA_REFUSED, 1);
    hsaKmtFreeMemory(ctl, 4096);
    free(q);
    return sdma ? HSAKMT_STATUS_ERROR : HSAKMT_STATUS_OUT_OF_RESOURCES;
  }
  q->id = (HSA_QUEUEID)(slot + 1);
  pthread_mutex_init(&q->mu, NULL);
  atomic_store(&q->refs, 1);
  q->type = type; q->node = node; q->ring = addr; q->ring_size = size; q->ctl = ctl;
  q->doorbell = &q->ctl[0];
  if (sdma) {
    q->rptr = &q->ctl[1];
    q->wptr = &q->ctl[2];
    r->Queue_read_ptr_aql = (HSAuint64 *)q->rptr;
    r->Queue_write_ptr_aql = (HSAuint64 *)q->wptr;
    d->sdma_queues++;
    COUNT(node, C_SDMA_QUEUES, 1);
  } else {
    q->rptr = r->Queue_read_ptr_aql;
    q->wptr = r->Queue_write_ptr_aql;
    *q->doorbell = UINT64_MAX;
    q->last_db = UINT64_MAX;
    q->fetch_idx = UINT64_MAX;
    COUNT(node, C_AQL_QUEUES, 1);
  }
  r->QueueId = q->id;
  r->Queue_DoorBell_aql = (HSAuint64 *)q->doorbell;
  if (atomic_load(&d->evicted)) atomic_store(&q->halted, 1);   /* kfd create_queue: evicted while qpd->evicted */
  g_queues[slot] = q;
  d->queues[d->nqueues++] = q;
  pthread_mutex_unlock(&d->lock);
  pthread_mutex_unlock(&g_q_lock);
  return HSAKMT_STATUS_SUCCESS;
}

EXPORT HSAKMT_STATUS hsaKmtUpdateQueue(HSA_QUEUEID id, HSAuint32 pct, HSA_QUEUE_PRIORITY prio, void *addr,
                                       HSAuint64 size, HsaEvent *ev) {
  (void)id; (void)pct; (void)prio; (void)addr; (void)size; (void)ev;
  return HSAKMT_STATUS_SUCCESS;
}

EXPORT HSAKMT_STATUS hsaKmtDestroyQueue(HSA_QUEUEID id) {
  pthread_mutex_lock(&g_q_lock);
  vqueue_t *q = id >= 1 && id <= MAX_QUEUES ? g_queues[id - 1] : NULL;
  if (!q) { pthread_mutex_unlock(&g_q_lock); return HSAKMT_STATUS_INVALID_PARAMETER; }
  g_queues[id - 1] = NULL;
  vdev_t *d = &g_dev[q->node];
  pthread_mutex_lock(&d->lock);    /* the engine is between steps: it never sees q again */
  for (int i = 0; i < d->nqueues; i++)
    if (d->queues[i] == q) { d->queues[i] = d->queues[--d->nqueues]; break; }
  if (q->type != HSA_QUEUE_COMPUTE_AQL) d->sdma_queues--;
  pthread_mutex_unlock(&d->lock);
  pthread_mutex_unlock(&g_q_lock);
  pthread_mutex_lock(&q->mu);     /* waits for a dispatch completing now, not for a running body */
  q->destroyed = 1;
  pthread_mutex_unlock(&q->mu);
  hsaKmtFreeMemory(q->ctl, 4096);
  queue_unref(q);
  return HSAKMT_STATUS_SUCCESS;
}

EXPORT HSAKMT_STATUS hsaKmtSetQueueCUMask(HSA_QUEUEID id, HSAuint32 n, HSAuint32 *mask) { (void)id; (void)n; (void)mask; return HSAKMT_STATUS_SUCCESS; }
EXPORT HSAKMT_STATUS hsaKmtAllocQueueGWS(HSA_QUEUEID id, HSAuint32 n, HSAuint32 *first) { (void)id; (void)n; (void)first; return HSAKMT_STATUS_NOT_SUPPORTED; }

/* ------------------------------------------------------------------ open / close */
EXPORT HSAKMT_STATUS hsaKmtOpenKFD(void) {
  pthread_mutex_lock(&g_cfg_lock);
  if (g_open++ == 0) {
    atomic_fetch_add(&g_generation, 1);
    for (int n = 1; n <= g_gpus; n++) {
      vdev_t *d = &g_dev[n];
      pthread_mutex_init(&d->lock, NULL);
      d->nqueues = 0;
      d->sdma_queues = 0;
      atomic_store(&d->evicted, 0);
      atomic_store(&d->stop, 0);
      atomic_store(&d->pending_queue_error, 0);
      atomic_store(&d->pending_memory_fault, 0);
      atomic_store(&g_drop_interrupts[n], 0);
      if (!d->ncu) {   /* compute units live as long as the process: a body may outlast ROCr */
        pthread_mutex_init(&d->job_lock, NULL);
        pthread_cond_init(&d->job_cond, NULL);
        d->jobs = NULL;
        d->jobs_tail = &d->jobs;
        for (int c = 0; c < COMPUTE_UNITS; c++)
          if (pthread_create(&d->cu[d->ncu], NULL, compute_unit, d) == 0) d->ncu++;
      }
      d->running = pthread_create(&d->thread, NULL, engine, d) == 0;
    }
  }
  pthread_mutex_unlock(&g_cfg_lock);
  return HSAKMT_STATUS_SUCCESS;
}

EXPORT HSAKMT_STATUS hsaKmtCloseKFD(void) {
  pthread_mutex_lock(&g_cfg_lock);
  if (g_open && --g_open == 0) {
    for (int n = 1; n <= g_gpus; n++) {
      vdev_t *d = &g_dev[n];
      atomic_store(&d->stop, 1);
      if (d->running) pthread_join(d->thread, NULL);
      d->running = 0;
    }
    pthread_mutex_lock(&g_kc_lock);
    memset(g_kcache, 0, sizeof g_kcache);
    pthread_mutex_unlock(&g_kc_lock);
  }
  pthread_mutex_unlock(&g_cfg_lock);
  return HSAKMT_STATUS_SUCCESS;
}

/* ------------------------------------------------------------------ control API (ctypes) */
/* Devices for the next hsaKmtOpenKFD: -1 while KFD is open (ROCr initialised), else 0. */
EXPORT int vkfd_configure(int gpus, int sdma_queues, int eager) {
  if (gpus < 1 || gpus > MAX_GPUS || sdma_queues < 0) return -2;
  pthread_mutex_lock(&g_cfg_lock);
  int open = g_open;
  if (!open) {
    g_gpus = gpus;
    for (int n = 0; n < MAX_NODES; n++) g_sdma_limit[n] = sdma_queues;
    memset(g_counters, 0, sizeof g_counters);
  }
  pthread_mutex_unlock(&g_cfg_lock);
  if (open) return -1;
  atomic_store(&g_eager, eager != 0);
  return 0;
}
EXPORT int vkfd_gpus(void) { return g_gpus; }
/* Which opening of the KFD this is: each is a fresh process to the virtual KFD (evictions end). */
EXPORT int vkfd_generation(void) { return atomic_load(&g_generation); }
EXPORT int vkfd_is_open(void) { return g_open; }
EXPORT int vkfd_sdma_limit(int gpu) { return gpu >= 0 && gpu < g_gpus ? g_sdma_limit[gpu + 1] : -1; }
EXPORT void vkfd_set_eager(int eager) { atomic_store(&g_eager, eager != 0); }
EXPORT int vkfd_eager(void) { return atomic_load(&g_eager); }

/* Set (or clear, NULL) the callback that runs user dispatches. Returns once no call of the
 * previous callback is running, so its owner may go away. */
EXPORT void vkfd_set_dispatch_callback(dispatch_cb_t cb) {
  atomic_store(&g_dispatch_cb, cb);
  while (atomic_load(&g_cb_inflight)) { struct timespec ts = {0, 100000}; nanosleep(&ts, NULL); }
}
/* The faulting address of a dispatch whose callback returns < 0. */
EXPORT void vkfd_report_fault(uint64_t addr) { atomic_store(&g_fault_addr, addr); }

EXPORT int vkfd_counter_count(void) { return C_COUNT; }
EXPORT const char *vkfd_counter_name(int i) { return i >= 0 && i < C_COUNT ? COUNTER_NAMES[i] : NULL; }
EXPORT uint64_t vkfd_counter(int gpu, int i) {
  return gpu >= 0 && gpu < MAX_GPUS && i >= 0 && i < C_COUNT ? atomic_load(&g_counters[gpu + 1][i]) : 0;
}

/* Fault injection on GPU `gpu` (0-based): 0 when done, -1 for a bad GPU or kind. */
enum { INJECT_QUEUE_ERROR = 1, INJECT_MEMORY_FAULT = 2, INJECT_LOST_INTERRUPTS = 3, INJECT_SDMA_QUEUES = 4,
       INJECT_MEMORY_FAULT_NEXT = 5 };
EXPORT int vkfd_inject(int gpu, int kind, uint64_t arg) {
  if (gpu < 0 || gpu >= g_gpus) return -1;
  HSAuint32 node = (HSAuint32)gpu + 1;
  switch (kind) {
    case INJECT_QUEUE_ERROR: atomic_store(&g_dev[node].pending_queue_error, arg ? arg : 0x80000000ULL); return 0;
    case INJECT_MEMORY_FAULT: vm_fault(node, arg); return 0;
    case INJECT_LOST_INTERRUPTS: atomic_store(&g_drop_interrupts[node], (int64_t)arg); return 0;
    case INJECT_MEMORY_FAULT_NEXT: atomic_store(&g_dev[node].pending_memory_fault, 1); return 0;
    case INJECT_SDMA_QUEUES: pthread_mutex_lock(&g_cfg_lock); g_sdma_limit[node] = (int)arg; pthread_mutex_unlock(&g_cfg_lock); return 0;
    default: return -1;
  }
}

/* The host address behind a GPU address range (0 where none), and whether a GPU may access it. */
EXPORT uint64_t vkfd_host_address(uint64_t va, uint64_t n) { return (uint64_t)(uintptr_t)g2h(va, n); }
EXPORT int vkfd_can_access(int gpu, uint64_t va, uint64_t n) { return node_can_access(va, n, (HSAuint32)gpu + 1); }
/* [base, base + size) of the allocation or registration holding GPU address va; 0 if none. */
EXPORT int vkfd_allocation(uint64_t va, uint64_t *base, uint64_t *size) {
  pthread_mutex_lock(&g_mem_lock);
  alloc_t *a = find_gpu_locked(va, 1);
  if (a) { *base = a->gpu_va; *size = a->size; }
  pthread_mutex_unlock(&g_mem_lock);
  return a != NULL;
}
/* A kernel object aiogpu loaded (its dispatches go to the callback, whatever its code). */
EXPORT void vkfd_note_user_kernel(uint64_t kobj) { kcache_set(kobj, K_USER); }
/* How many threads wait on a KFD event now (tests order a set after the waits with it). */
EXPORT int vkfd_event_waiters(HsaEvent *ev) {
  int n = 0;
  pthread_mutex_lock(&g_ev_lock);
  for (waiter_t *w = ((fevent_t *)ev)->waiters; w; w = w->next) n++;
  pthread_mutex_unlock(&g_ev_lock);
  return n;
}
/* Drop cached kernel kinds in freed code memory (called when aiogpu unloads an executable). */
EXPORT void vkfd_forget_code(uint64_t base, uint64_t size) { kcache_forget(base, size); }
/* Whether this library is the virtual KFD (for a loader that found a libhsakmt.so.1). */
EXPORT const char *vkfd_version(void) { return "vkfd 1 (ROCr 5.2.3 thunk ABI HSAKMT_1)"; }
