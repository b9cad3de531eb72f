/* CUDA pages (the daemon's cuda backend): the driver's VMM API, loaded with
 * dlopen so that a build without CUDA still works. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "mapper.h"
#include "status.h"
/* ---- minimal CUDA driver declarations (values as in NVIDIA's cuda.h) ---- */
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct {
    char bytes[16];
} CUuuid;
typedef struct {
    int type; /* CUmemLocationType */
    int id;
} CUmemLocation;
typedef struct {
    CUmemLocation location;
    int flags; /* CUmemAccess_flags */
} CUmemAccessDesc;

typedef struct {
    int type;                 /* CUmemAllocationType */
    int requestedHandleTypes; /* CUmemAllocationHandleType */
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;
_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp as in cuda.h");
_Static_assert(offsetof(CUmemAllocationProp, location) == 8, "CUmemAllocationProp as in cuda.h");
_Static_assert(offsetof(CUmemAllocationProp, allocFlags) == 24, "CUmemAllocationProp as in cuda.h");
#define CUDA_SUCCESS 0
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CU_MEM_ALLOCATION_TYPE_PINNED 0x1
#define CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 0x1
#define CU_MEM_LOCATION_TYPE_DEVICE 0x1
#define CU_MEM_ACCESS_FLAGS_PROT_READWRITE 0x3

/* One table of driver entry points: the C prototype of each in the member's
 * type, the exported names tried in order (versioned first). */
struct cuda_api {
    CUresult (*Init)(unsigned int flags);
    CUresult (*DeviceGetCount)(int *count);
    CUresult (*DeviceGet)(CUdevice *device, int ordinal);
    CUresult (*DeviceGetUuid)(CUuuid *uuid, CUdevice dev);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *pctx, CUdevice dev);
    CUresult (*DevicePrimaryCtxRelease)(CUdevice dev);
    CUresult (*CtxSetCurrent)(CUcontext ctx);
    CUresult (*CtxSynchronize)(void); /* optional */
    CUresult (*MemAddressReserve)(CUdeviceptr *ptr, size_t size, size_t alignment,
                                  CUdeviceptr addr, unsigned long long flags);
    CUresult (*MemAddressFree)(CUdeviceptr ptr, size_t size);
    CUresult (*MemImportFromShareableHandle)(CUmemGenericAllocationHandle *handle,
                                             void *osHandle, int shHandleType);
    CUresult (*MemMap)(CUdeviceptr ptr, size_t size, size_t offset,
                       CUmemGenericAllocationHandle handle, unsigned long long flags);
    CUresult (*MemSetAccess)(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
                             size_t count);
    CUresult (*MemRelease)(CUmemGenericAllocationHandle handle);
    CUresult (*MemCreate)(CUmemGenericAllocationHandle *handle, size_t size,
                          const CUmemAllocationProp *prop, unsigned long long flags); /* optional */
    CUresult (*MemUnmap)(CUdeviceptr ptr, size_t size);
    CUresult (*MemsetD8)(CUdeviceptr dst, unsigned char uc, size_t n);
    CUresult (*MemcpyHtoD)(CUdeviceptr dst, const void *src, size_t n);
    CUresult (*MemcpyDtoH)(void *dst, CUdeviceptr src, size_t n);
    CUresult (*GetErrorName)(CUresult error, const char **pStr);
};

static struct cuda_api g_cu;
static pthread_once_t g_cu_once = PTHREAD_ONCE_INIT;
static kvc_status g_cu_status = KVC_OK;
static char g_cu_error[512];

struct sym {
    void **slot;
    const char *names[3];
    int optional;
};

static void cuda_load(void)
{
    const char *path = getenv("KVCACHED_LIBCUDA");
    if (!path || !*path)
        path = "libcuda.so.1";
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        g_cu_status = KVC_ERR_DRIVER;
        snprintf(g_cu_error, sizeof g_cu_error, "cannot load the CUDA driver %s: %s", path,
                 dlerror());
        return;
    }
    /* Only the versioned names where cuda.h redirects: the unversioned
     * cuMemsetD8 / cuMemcpyHtoD / cuMemcpyDtoH are the old 32-bit-size ABI. */
    struct sym syms[] = {
        {(void **)&g_cu.Init, {"cuInit"}, 0},
        {(void **)&g_cu.DeviceGetCount, {"cuDeviceGetCount"}, 0},
        {(void **)&g_cu.DeviceGet, {"cuDeviceGet"}, 0},
        {(void **)&g_cu.DeviceGetUuid, {"cuDeviceGetUuid_v2"}, 0},
        {(void **)&g_cu.DevicePrimaryCtxRetain, {"cuDevicePrimaryCtxRetain"}, 0},
        {(void **)&g_cu.DevicePrimaryCtxRelease,
         {"cuDevicePrimaryCtxRelease_v2"}, 0},
        {(void **)&g_cu.CtxSetCurrent, {"cuCtxSetCurrent"}, 0},
        {(void **)&g_cu.CtxSynchronize, {"cuCtxSynchronize"}, 1},
        {(void **)&g_cu.MemAddressReserve, {"cuMemAddressReserve"}, 0},
        {(void **)&g_cu.MemAddressFree, {"cuMemAddressFree"}, 0},
        {(void **)&g_cu.MemImportFromShareableHandle, {"cuMemImportFromShareableHandle"}, 0},
        {(void **)&g_cu.MemMap, {"cuMemMap"}, 0},
        {(void **)&g_cu.MemSetAccess, {"cuMemSetAccess"}, 0},
        {(void **)&g_cu.MemRelease, {"cuMemRelease"}, 0},
        {(void **)&g_cu.MemCreate, {"cuMemCreate"}, 1},
        {(void **)&g_cu.MemUnmap, {"cuMemUnmap"}, 0},
        {(void **)&g_cu.MemsetD8, {"cuMemsetD8_v2"}, 0},
        {(void **)&g_cu.MemcpyHtoD, {"cuMemcpyHtoD_v2"}, 0},
        {(void **)&g_cu.MemcpyDtoH, {"cuMemcpyDtoH_v2"}, 0},
        {(void **)&g_cu.GetErrorName, {"cuGetErrorName"}, 1},
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        void *f = NULL;
        for (int k = 0; k < 3 && syms[i].names[k] && !f; k++)
            f = dlsym(lib, syms[i].names[k]);
        if (!f && !syms[i].optional) {
            g_cu_status = KVC_ERR_DRIVER;
            snprintf(g_cu_error, sizeof g_cu_error, "the CUDA driver %s lacks %s", path,
                     syms[i].names[0]);
            dlclose(lib);
            memset(&g_cu, 0, sizeof g_cu);
            return;
        }
        *syms[i].slot = f;
    }
    CUresult r = g_cu.Init(0);
    if (r != CUDA_SUCCESS) {
        g_cu_status = KVC_ERR_DRIVER;
        snprintf(g_cu_error, sizeof g_cu_error, "cuInit failed with CUresult %d", r);
    }
    /* The library stays loaded for the life of the process (as libcudart). */
}

static const char *cu_name(CUresult r)
{
    const char *s = NULL;
    if (g_cu.GetErrorName && g_cu.GetErrorName(r, &s) == CUDA_SUCCESS && s)
        return s;
    return "CUDA_ERROR_UNKNOWN";
}

static kvc_status cu_fail(const char *call, CUresult r)
{
    return kvc_fail(KVC_ERR_DRIVER, "%s failed: %s (%d)", call, cu_name(r), r);
}

#define CU_CHECK(call, expr)                   \
    do {                                       \
        CUresult r_ = (expr);                  \
        if (r_ != CUDA_SUCCESS)                \
            return cu_fail(call, r_);          \
    } while (0)

/* Kept handles (docs/protocol.md "Kept handles"): page id -> the handle
 * imported for it, kept instead of released so that the page, when it
 * comes back to this session, is mapped without an import. An open-
 * addressing table (linear probing, backward-shift deletion). */
struct keep_table {
    uint64_t *ids;
    CUmemGenericAllocationHandle *handles;
    unsigned char *used;
    size_t cap, n; /* cap: 0 or a power of two, at most half full */
};

#define KT_NONE ((size_t)-1)

static size_t kt_slot(uint64_t id, size_t cap)
{
    id ^= id >> 33; /* splitmix64's finalizer */
    id *= 0xff51afd7ed558ccdull;
    id ^= id >> 33;
    id *= 0xc4ceb9fe1a85ec53ull;
    id ^= id >> 33;
    return (size_t)id & (cap - 1);
}

static size_t kt_find(const struct keep_table *t, uint64_t id)
{
    if (!t->cap)
        return KT_NONE;
    for (size_t i = kt_slot(id, t->cap);; i = (i + 1) & (t->cap - 1)) {
        if (!t->used[i])
            return KT_NONE;
        if (t->ids[i] == id)
            return i;
    }
}

static int kt_grow(struct keep_table *t)
{
    size_t cap = t->cap ? 2 * t->cap : 64;
    struct keep_table nt = {calloc(cap, sizeof(uint64_t)),
                            calloc(cap, sizeof(CUmemGenericAllocationHandle)), calloc(cap, 1), cap,
                            0};
    if (!nt.ids || !nt.handles || !nt.used) {
        free(nt.ids);
        free(nt.handles);
        free(nt.used);
        return -1;
    }
    for (size_t i = 0; i < t->cap; i++)
        if (t->used[i]) {
            size_t j = kt_slot(t->ids[i], cap);
            while (nt.used[j])
                j = (j + 1) & (cap - 1);
            nt.used[j] = 1;
            nt.ids[j] = t->ids[i];
            nt.handles[j] = t->handles[i];
            nt.n++;
        }
    free(t->ids);
    free(t->handles);
    free(t->used);
    *t = nt;
    return 0;
}

/* Add id (not in the table). -1: no memory. */
static int kt_put(struct keep_table *t, uint64_t id, CUmemGenericAllocationHandle h)
{
    if (2 * (t->n + 1) > t->cap && kt_grow(t) != 0)
        return -1;
    size_t i = kt_slot(id, t->cap);
    while (t->used[i])
        i = (i + 1) & (t->cap - 1);
    t->used[i] = 1;
    t->ids[i] = id;
    t->handles[i] = h;
    t->n++;
    return 0;
}

static void kt_del(struct keep_table *t, size_t i)
{
    size_t mask = t->cap - 1;
    t->used[i] = 0;
    t->n--;
    /* backward shift: move up every entry of the run after i that may sit in the hole */
    for (size_t j = (i + 1) & mask; t->used[j]; j = (j + 1) & mask) {
        size_t home = kt_slot(t->ids[j], t->cap);
        /* the entry at j may move to i if its home is not in (i, j] (cyclically) */
        int stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (stays)
            continue;
        t->used[i] = 1;
        t->ids[i] = t->ids[j];
        t->handles[i] = t->handles[j];
        t->used[j] = 0;
        i = j;
    }
}

static void kt_free(struct keep_table *t)
{
    free(t->ids);
    free(t->handles);
    free(t->used);
    memset(t, 0, sizeof *t);
}

struct cuda_mapper {
    kvc_mapper base; /* first: a kvc_mapper * is a struct cuda_mapper * */
    CUdevice device;
    int ordinal;
    CUcontext ctx;
    /* Kept handles: keep_mu guards what follows; it is a leaf lock (no
     * other lock is taken under it), held for a cuMemMap from a kept
     * handle so that a DROP cannot release the handle under the map. */
    pthread_mutex_t keep_mu;
    struct keep_table kept;
    size_t keep_limit; /* 0: never keep */
    uint64_t keep_gen; /* counts keep_resets: a map that began before one keeps nothing */
};

static struct cuda_mapper *cm(kvc_mapper *m) { return (struct cuda_mapper *)m; }

static kvc_status cuda_create(const char *uuid, kvc_mapper **out)
{
    pthread_once(&g_cu_once, cuda_load);
    if (g_cu_status != KVC_OK)
        return kvc_fail(g_cu_status, "%s", g_cu_error);
    int count = 0;
    CU_CHECK("cuDeviceGetCount", g_cu.DeviceGetCount(&count));
    for (int i = 0; i < count; i++) {
        CUdevice dev;
        CUuuid id;
        char text[41];
        CU_CHECK("cuDeviceGet", g_cu.DeviceGet(&dev, i));
        CU_CHECK("cuDeviceGetUuid_v2", g_cu.DeviceGetUuid(&id, dev));
        kvc_format_gpu_uuid((const unsigned char *)id.bytes, text);
        if (strcasecmp(text, uuid) != 0)
            continue;
        struct cuda_mapper *m = calloc(1, sizeof *m);
        if (!m)
            return kvc_fail(KVC_ERR_NO_MEMORY, "out of memory");
        m->device = dev;
        m->ordinal = i;
        pthread_mutex_init(&m->keep_mu, NULL);
        CUresult r = g_cu.DevicePrimaryCtxRetain(&m->ctx, dev);
        if (r != CUDA_SUCCESS) {
            pthread_mutex_destroy(&m->keep_mu);
            free(m);
            return cu_fail("cuDevicePrimaryCtxRetain", r);
        }
        *out = &m->base;
        return KVC_OK;
    }
    return kvc_fail(KVC_ERR_NOT_FOUND,
                    "no CUDA device with UUID %s among the %d this process sees "
                    "(CUDA_VISIBLE_DEVICES?)",
                    uuid, count);
}

static void cuda_keep_reset(kvc_mapper *m, size_t limit);

static void cuda_destroy(kvc_mapper *m)
{
    cuda_keep_reset(m, 0);
    kt_free(&cm(m)->kept);
    pthread_mutex_destroy(&cm(m)->keep_mu);
    g_cu.DevicePrimaryCtxRelease(cm(m)->device);
    free(cm(m));
}

/* The context is current per thread: make it current on the calling one. */
#define CU_CURRENT(m) CU_CHECK("cuCtxSetCurrent", g_cu.CtxSetCurrent(cm(m)->ctx))

static kvc_status cuda_reserve(kvc_mapper *m, uint64_t size, uint64_t alignment, uintptr_t *base)
{
    CU_CURRENT(m);
    CUdeviceptr p = 0;
    CUresult r = g_cu.MemAddressReserve(&p, (size_t)size, (size_t)alignment, 0, 0);
    if (r == CUDA_ERROR_OUT_OF_MEMORY)
        return kvc_fail(KVC_ERR_NO_MEMORY,
                        "cuMemAddressReserve of %llu bytes: out of address space",
                        (unsigned long long)size);
    if (r != CUDA_SUCCESS)
        return cu_fail("cuMemAddressReserve", r);
    *base = (uintptr_t)p;
    return KVC_OK;
}

static kvc_status cuda_release(kvc_mapper *m, uintptr_t base, uint64_t size)
{
    CU_CURRENT(m);
    CU_CHECK("cuMemAddressFree", g_cu.MemAddressFree((CUdeviceptr)base, (size_t)size));
    return KVC_OK;
}

/* Map handle h at addr with read-write access for this device; the handle
 * is released in every case (the mapping keeps the page alive). */
static kvc_status cuda_map_handle(kvc_mapper *m, uintptr_t addr, CUmemGenericAllocationHandle h,
                                  uint64_t size)
{
    CUresult r = g_cu.MemMap((CUdeviceptr)addr, (size_t)size, 0, h, 0);
    if (r != CUDA_SUCCESS) {
        g_cu.MemRelease(h);
        return cu_fail("cuMemMap", r);
    }
    CUmemAccessDesc desc;
    memset(&desc, 0, sizeof desc);
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = cm(m)->ordinal;
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = g_cu.MemSetAccess((CUdeviceptr)addr, (size_t)size, &desc, 1);
    if (r != CUDA_SUCCESS) {
        g_cu.MemUnmap((CUdeviceptr)addr, (size_t)size);
        g_cu.MemRelease(h);
        return cu_fail("cuMemSetAccess", r);
    }
    r = g_cu.MemRelease(h);
    if (r != CUDA_SUCCESS) {
        g_cu.MemUnmap((CUdeviceptr)addr, (size_t)size);
        return cu_fail("cuMemRelease", r);
    }
    return KVC_OK;
}

/* One run of cuda_map_pages: what it maps, how far it got, and the handles
 * it imported and has not released yet (keeping only). */
struct map_run {
    struct cuda_mapper *c;
    uintptr_t addr;
    uint64_t page;
    const uint64_t *ids;
    const int *fds;
    size_t n;
    size_t closed, mapped; /* fds closed, pages mapped: both prefixes */
    int keeping;           /* kept handles on for this run */
    uint64_t gen;          /* the cache's generation when the run began */
    CUmemGenericAllocationHandle *fresh;
    unsigned char *is_fresh;
};

/* Whether the run keeps handles, and room for the ones it imports. On
 * failure every fd is closed. */
static kvc_status map_run_begin(struct map_run *run)
{
    struct cuda_mapper *c = run->c;
    if (run->ids) {
        pthread_mutex_lock(&c->keep_mu);
        run->keeping = c->keep_limit > 0;
        run->gen = c->keep_gen;
        pthread_mutex_unlock(&c->keep_mu);
    }
    if (!run->keeping)
        return KVC_OK;
    run->fresh = calloc(run->n, sizeof *run->fresh);
    run->is_fresh = calloc(run->n, 1);
    if (run->fresh && run->is_fresh)
        return KVC_OK;
    free(run->fresh);
    free(run->is_fresh);
    run->fresh = NULL;
    run->is_fresh = NULL;
    for (size_t i = 0; i < run->n; i++)
        close(run->fds[i]);
    return kvc_fail(KVC_ERR_NO_MEMORY, "out of memory");
}

/* Map the next page from its kept handle, if one is kept (its fd closed:
 * no import, no release). 1 if it was kept, *st saying how the map went. */
static int map_run_from_kept(struct map_run *run, CUdeviceptr at, kvc_status *st)
{
    struct cuda_mapper *c = run->c;
    CUresult r = CUDA_SUCCESS;
    int hit = 0;
    pthread_mutex_lock(&c->keep_mu);
    size_t k = kt_find(&c->kept, run->ids[run->closed]);
    if (k != KT_NONE) {
        hit = 1; /* under the lock: a DROP cannot release it meanwhile */
        r = g_cu.MemMap(at, (size_t)run->page, 0, c->kept.handles[k], 0);
    }
    pthread_mutex_unlock(&c->keep_mu);
    if (!hit)
        return 0;
    close(run->fds[run->closed++]);
    if (r != CUDA_SUCCESS)
        *st = cu_fail("cuMemMap", r);
    else
        run->mapped++;
    return 1;
}

/* Map the next page: from its kept handle, or imported from its fd (kept
 * for later when keeping, else released: the mapping keeps the page). */
static kvc_status map_run_next(struct map_run *run)
{
    const CUdeviceptr at = (CUdeviceptr)(run->addr + run->mapped * run->page);
    kvc_status st = KVC_OK;
    if (run->keeping && map_run_from_kept(run, at, &st))
        return st;
    CUmemGenericAllocationHandle h = 0;
    /* the fd travels BY VALUE in the void* argument */
    CUresult r = g_cu.MemImportFromShareableHandle(&h, (void *)(uintptr_t)run->fds[run->closed],
                                                   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    close(run->fds[run->closed++]);
    if (r != CUDA_SUCCESS)
        return cu_fail("cuMemImportFromShareableHandle", r);
    r = g_cu.MemMap(at, (size_t)run->page, 0, h, 0);
    if (r != CUDA_SUCCESS) {
        g_cu.MemRelease(h);
        return cu_fail("cuMemMap", r);
    }
    run->mapped++;
    if (run->keeping) {
        run->fresh[run->mapped - 1] = h;
        run->is_fresh[run->mapped - 1] = 1;
        return KVC_OK;
    }
    r = g_cu.MemRelease(h); /* the mapping keeps the page */
    return r == CUDA_SUCCESS ? KVC_OK : cu_fail("cuMemRelease", r);
}

/* One cuMemSetAccess over the whole mapped run. */
static kvc_status map_run_set_access(const struct map_run *run)
{
    CUmemAccessDesc desc;
    memset(&desc, 0, sizeof desc);
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = run->c->ordinal;
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CUresult r = g_cu.MemSetAccess((CUdeviceptr)run->addr, (size_t)(run->n * run->page), &desc, 1);
    return r == CUDA_SUCCESS ? KVC_OK : cu_fail("cuMemSetAccess", r);
}

/* A mapped run keeps what fits of the handles it imported; a reset since
 * the run began (session end, resume) keeps nothing. The rest are released. */
static kvc_status map_run_keep(struct map_run *run)
{
    struct cuda_mapper *c = run->c;
    kvc_status st = KVC_OK;
    pthread_mutex_lock(&c->keep_mu);
    for (size_t i = 0; i < run->n; i++)
        if (run->is_fresh[i] && c->keep_gen == run->gen && c->kept.n < c->keep_limit &&
            kt_find(&c->kept, run->ids[i]) == KT_NONE &&
            kt_put(&c->kept, run->ids[i], run->fresh[i]) == 0)
            run->is_fresh[i] = 0;
    pthread_mutex_unlock(&c->keep_mu);
    for (size_t i = 0; i < run->n; i++)
        if (run->is_fresh[i]) {
            run->is_fresh[i] = 0;
            CUresult r = g_cu.MemRelease(run->fresh[i]); /* the mapping keeps the page */
            if (r != CUDA_SUCCESS && st == KVC_OK)
                st = cu_fail("cuMemRelease", r);
        }
    return st;
}

/* The fds not reached are closed; a failed run (st) is unmapped, then the
 * handles it imported are released. Returns st. */
static kvc_status map_run_end(struct map_run *run, kvc_status st)
{
    for (; run->closed < run->n; run->closed++)
        close(run->fds[run->closed]);
    if (st != KVC_OK)
        for (size_t i = 0; i < run->mapped; i++)
            g_cu.MemUnmap((CUdeviceptr)(run->addr + i * run->page), (size_t)run->page);
    if (run->keeping)
        for (size_t i = 0; i < run->mapped; i++)
            if (run->is_fresh[i])
                g_cu.MemRelease(run->fresh[i]); /* a failed run: after its unmap */
    free(run->fresh);
    free(run->is_fresh);
    return st;
}

/* n pages in a row: import and map each, then one cuMemSetAccess over the
 * whole run (the driver sets access on a fully mapped range of several
 * mappings; one call instead of n, each of which measured 25 us p50 per
 * 2 MiB page on an H200, docs/gpu-check.md). All or nothing.
 *
 * With ids (kept handles on): a page whose handle is kept is mapped from it
 * (its fd closed, no import, no release); a page imported here is kept,
 * once the run is mapped, while fewer than keep_limit handles are kept
 * (else released, as without a cache: the cache never evicts). A failed run
 * leaves the cache as it was. */
static kvc_status cuda_map_pages(kvc_mapper *m, uintptr_t addr, const uint64_t *ids,
                                 const int *fds, size_t n, uint64_t page)
{
    if (n == 0)
        return KVC_OK;
    struct map_run run;
    memset(&run, 0, sizeof run);
    run.c = cm(m);
    run.addr = addr;
    run.page = page;
    run.ids = ids;
    run.fds = fds;
    run.n = n;
    kvc_status st = map_run_begin(&run);
    if (st != KVC_OK)
        return st;
    CUresult r = g_cu.CtxSetCurrent(run.c->ctx);
    if (r != CUDA_SUCCESS)
        st = cu_fail("cuCtxSetCurrent", r);
    while (st == KVC_OK && run.closed < n)
        st = map_run_next(&run);
    if (st == KVC_OK)
        st = map_run_set_access(&run);
    if (st == KVC_OK && run.keeping)
        st = map_run_keep(&run);
    return map_run_end(&run, st);
}

static kvc_status cuda_map_run(kvc_mapper *m, uintptr_t addr, const int *fds, size_t n, uint64_t page)
{
    return cuda_map_pages(m, addr, NULL, fds, n, page);
}

static kvc_status cuda_map_run_ids(kvc_mapper *m, uintptr_t addr, const uint64_t *ids,
                                   const int *fds, size_t n, uint64_t page)
{
    return cuda_map_pages(m, addr, ids, fds, n, page);
}

/* Release handles taken out of the table (keep_mu not held). */
static void release_handles(struct cuda_mapper *c, const CUmemGenericAllocationHandle *hs, size_t n)
{
    if (!n)
        return;
    g_cu.CtxSetCurrent(c->ctx);
    for (size_t i = 0; i < n; i++)
        g_cu.MemRelease(hs[i]); /* a mapping of the page (if any) keeps it */
}

static void cuda_keep_reset(kvc_mapper *m, size_t limit)
{
    struct cuda_mapper *c = cm(m);
    pthread_mutex_lock(&c->keep_mu);
    struct keep_table old = c->kept;
    memset(&c->kept, 0, sizeof c->kept);
    c->keep_limit = limit;
    c->keep_gen++;
    pthread_mutex_unlock(&c->keep_mu);
    for (size_t i = 0; i < old.cap; i++)
        if (old.used[i])
            release_handles(c, &old.handles[i], 1);
    kt_free(&old);
}

static size_t cuda_kept(kvc_mapper *m, const uint64_t *ids, size_t n)
{
    struct cuda_mapper *c = cm(m);
    size_t k = 0;
    pthread_mutex_lock(&c->keep_mu);
    for (size_t i = 0; i < n && c->kept.n; i++)
        k += kt_find(&c->kept, ids[i]) != KT_NONE;
    pthread_mutex_unlock(&c->keep_mu);
    return k;
}

static size_t cuda_drop(kvc_mapper *m, const uint64_t *ids, size_t n)
{
    struct cuda_mapper *c = cm(m);
    CUmemGenericAllocationHandle one[16], *hs = one;
    size_t k = 0;
    pthread_mutex_lock(&c->keep_mu);
    if (c->kept.n > 16)
        hs = malloc((c->kept.n < n ? c->kept.n : n) * sizeof *hs);
    for (size_t i = 0; hs && i < n && c->kept.n; i++) {
        size_t at = kt_find(&c->kept, ids[i]);
        if (at == KT_NONE)
            continue;
        hs[k++] = c->kept.handles[at];
        kt_del(&c->kept, at);
    }
    pthread_mutex_unlock(&c->keep_mu);
    if (!hs) { /* no memory for the list: release one at a time */
        for (size_t i = 0; i < n; i++) {
            CUmemGenericAllocationHandle h = 0;
            int found = 0;
            pthread_mutex_lock(&c->keep_mu);
            size_t at = kt_find(&c->kept, ids[i]);
            if (at != KT_NONE) {
                h = c->kept.handles[at];
                kt_del(&c->kept, at);
                found = 1;
            }
            pthread_mutex_unlock(&c->keep_mu);
            if (found) {
                release_handles(c, &h, 1);
                k++;
            }
        }
        return k;
    }
    release_handles(c, hs, k);
    if (hs != one)
        free(hs);
    return k;
}

static size_t cuda_kept_total(kvc_mapper *m)
{
    struct cuda_mapper *c = cm(m);
    pthread_mutex_lock(&c->keep_mu);
    size_t n = c->kept.n;
    pthread_mutex_unlock(&c->keep_mu);
    return n;
}

static kvc_status cuda_map(kvc_mapper *m, uintptr_t addr, int fd, uint64_t size)
{
    return cuda_map_run(m, addr, &fd, 1, size);
}

/* A page of ordinary device memory, this process's own (no shareable
 * handle: nobody else maps it). */
static kvc_status cuda_map_local(kvc_mapper *m, uintptr_t addr, uint64_t size)
{
    if (!g_cu.MemCreate)
        return kvc_fail(KVC_ERR_DRIVER, "the CUDA driver lacks cuMemCreate: no local pages");
    CU_CURRENT(m);
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = cm(m)->ordinal;
    CUmemGenericAllocationHandle h = 0;
    CUresult r = g_cu.MemCreate(&h, (size_t)size, &prop, 0);
    if (r == CUDA_ERROR_OUT_OF_MEMORY)
        return kvc_fail(KVC_ERR_NO_MEMORY, "cuMemCreate of a local page (%llu bytes): the device is out of memory",
                        (unsigned long long)size);
    if (r != CUDA_SUCCESS)
        return cu_fail("cuMemCreate", r);
    kvc_status st = cuda_map_handle(m, addr, h, size);
    if (st != KVC_OK)
        return st;
    /* as the daemon's pages: zeros (llama.cpp relies on cleared KV memory) */
    r = g_cu.MemsetD8((CUdeviceptr)addr, 0, (size_t)size);
    if (r != CUDA_SUCCESS) {
        g_cu.MemUnmap((CUdeviceptr)addr, (size_t)size);
        return cu_fail("cuMemsetD8_v2", r);
    }
    return KVC_OK;
}

/* One cuMemUnmap: a page, or a run of adjacent pages (the driver unmaps a
 * range made of several whole mappings in one call, as it sets access over
 * one). */
static kvc_status cuda_unmap(kvc_mapper *m, uintptr_t addr, uint64_t size)
{
    CU_CURRENT(m);
    CU_CHECK("cuMemUnmap", g_cu.MemUnmap((CUdeviceptr)addr, (size_t)size));
    return KVC_OK;
}

static kvc_status cuda_memset(kvc_mapper *m, uintptr_t addr, uint8_t value, uint64_t size)
{
    CU_CURRENT(m);
    CU_CHECK("cuMemsetD8_v2", g_cu.MemsetD8((CUdeviceptr)addr, value, (size_t)size));
    return KVC_OK;
}

static kvc_status cuda_write(kvc_mapper *m, uintptr_t addr, const void *src, uint64_t size)
{
    CU_CURRENT(m);
    CU_CHECK("cuMemcpyHtoD_v2", g_cu.MemcpyHtoD((CUdeviceptr)addr, src, (size_t)size));
    return KVC_OK;
}

static kvc_status cuda_read(kvc_mapper *m, uintptr_t addr, void *dst, uint64_t size)
{
    CU_CURRENT(m);
    CU_CHECK("cuMemcpyDtoH_v2", g_cu.MemcpyDtoH(dst, (CUdeviceptr)addr, (size_t)size));
    return KVC_OK;
}

static kvc_status cuda_sync(kvc_mapper *m)
{
    if (g_cu.CtxSynchronize) {
        CU_CURRENT(m);
        CU_CHECK("cuCtxSynchronize", g_cu.CtxSynchronize());
    }
    return KVC_OK;
}

const struct kvc_mapper_ops kvc_mapper_cuda_ops = {
    .create = cuda_create,
    .destroy = cuda_destroy,
    .reserve = cuda_reserve,
    .release = cuda_release,
    .map = cuda_map,
    .unmap = cuda_unmap,
    .map_run = cuda_map_run,
    .map_local = cuda_map_local,
    .memset = cuda_memset,
    .write = cuda_write,
    .read = cuda_read,
    .sync = cuda_sync,
    .map_run_ids = cuda_map_run_ids,
    .keep_reset = cuda_keep_reset,
    .kept = cuda_kept,
    .drop = cuda_drop,
    .kept_total = cuda_kept_total,
};
