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

struct cuda_mapper {
    kvc_mapper base; /* first: a kvc_mapper * is a struct cuda_mapper * */
    CUdevice device;
    int ordinal;
    CUcontext ctx;
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
        CUresult r = g_cu.DevicePrimaryCtxRetain(&m->ctx, dev);
        if (r != CUDA_SUCCESS) {
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

static void cuda_destroy(kvc_mapper *m)
{
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

/* n pages in a row: import and map each, then one cuMemSetAccess over the
 * whole run (the driver sets access on a fully mapped range of several
 * mappings; one call instead of n, each of which measured 25 us p50 per
 * 2 MiB page on an H200, docs/gpu-check.md). All or nothing. */
static kvc_status cuda_map_run(kvc_mapper *m, uintptr_t addr, const int *fds, size_t n, uint64_t page)
{
    size_t closed = 0, mapped = 0; /* fds closed, pages mapped: both prefixes */
    kvc_status st = KVC_OK;
    if (n == 0)
        return KVC_OK;
    CUresult r = g_cu.CtxSetCurrent(cm(m)->ctx);
    if (r != CUDA_SUCCESS)
        st = cu_fail("cuCtxSetCurrent", r);
    while (st == KVC_OK && closed < n) {
        CUmemGenericAllocationHandle h = 0;
        /* the fd travels BY VALUE in the void* argument */
        r = g_cu.MemImportFromShareableHandle(&h, (void *)(uintptr_t)fds[closed],
                                              CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        close(fds[closed++]);
        if (r != CUDA_SUCCESS) {
            st = cu_fail("cuMemImportFromShareableHandle", r);
            break;
        }
        r = g_cu.MemMap((CUdeviceptr)(addr + mapped * page), (size_t)page, 0, h, 0);
        if (r != CUDA_SUCCESS) {
            g_cu.MemRelease(h);
            st = cu_fail("cuMemMap", r);
            break;
        }
        mapped++;
        r = g_cu.MemRelease(h); /* the mapping keeps the page */
        if (r != CUDA_SUCCESS)
            st = cu_fail("cuMemRelease", r);
    }
    if (st == KVC_OK) {
        CUmemAccessDesc desc;
        memset(&desc, 0, sizeof desc);
        desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        desc.location.id = cm(m)->ordinal;
        desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        r = g_cu.MemSetAccess((CUdeviceptr)addr, (size_t)(n * page), &desc, 1);
        if (r == CUDA_SUCCESS)
            return KVC_OK;
        st = cu_fail("cuMemSetAccess", r);
    }
    for (; closed < n; closed++)
        close(fds[closed]);
    for (size_t i = 0; i < mapped; i++)
        g_cu.MemUnmap((CUdeviceptr)(addr + i * page), (size_t)page);
    return st;
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
};
