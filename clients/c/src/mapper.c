/* Page mapping: host (mmap) and CUDA (driver API through dlopen). */
#define _GNU_SOURCE
#include "mapper.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <unistd.h>

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

#define CUDA_SUCCESS 0
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

struct kvc_mapper {
    int cuda;
    CUdevice device;
    int ordinal;
    CUcontext ctx;
};

void kvc_format_gpu_uuid(const unsigned char b[16], char out[41])
{
    snprintf(out, 41,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
             b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
             b[14], b[15]);
}

kvc_status kvc_mapper_create_host(kvc_mapper **out)
{
    kvc_mapper *m = calloc(1, sizeof *m);
    if (!m)
        return kvc_fail(KVC_ERR_NO_MEMORY, "out of memory");
    *out = m;
    return KVC_OK;
}

kvc_status kvc_mapper_create_cuda(const char *uuid, kvc_mapper **out)
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
        kvc_mapper *m = calloc(1, sizeof *m);
        if (!m)
            return kvc_fail(KVC_ERR_NO_MEMORY, "out of memory");
        m->cuda = 1;
        m->device = dev;
        m->ordinal = i;
        CUresult r = g_cu.DevicePrimaryCtxRetain(&m->ctx, dev);
        if (r != CUDA_SUCCESS) {
            free(m);
            return cu_fail("cuDevicePrimaryCtxRetain", r);
        }
        *out = m;
        return KVC_OK;
    }
    return kvc_fail(KVC_ERR_NOT_FOUND,
                    "no CUDA device with UUID %s among the %d this process sees "
                    "(CUDA_VISIBLE_DEVICES?)",
                    uuid, count);
}

void kvc_mapper_destroy(kvc_mapper *m)
{
    if (!m)
        return;
    if (m->cuda)
        g_cu.DevicePrimaryCtxRelease(m->device);
    free(m);
}

int kvc_mapper_is_cuda(const kvc_mapper *m) { return m->cuda; }
int kvc_mapper_ordinal(const kvc_mapper *m) { return m->ordinal; }

/* The context is current per thread: make it current on the calling one. */
#define CU_CURRENT(m) CU_CHECK("cuCtxSetCurrent", g_cu.CtxSetCurrent((m)->ctx))

kvc_status kvc_mapper_reserve(kvc_mapper *m, uint64_t size, uint64_t alignment, uintptr_t *base)
{
    if (m->cuda) {
        CU_CURRENT(m);
        CUdeviceptr p = 0;
        CUresult r = g_cu.MemAddressReserve(&p, (size_t)size, (size_t)alignment, 0, 0);
        if (r == 2 /* CUDA_ERROR_OUT_OF_MEMORY */)
            return kvc_fail(KVC_ERR_NO_MEMORY,
                            "cuMemAddressReserve of %llu bytes: out of address space",
                            (unsigned long long)size);
        if (r != CUDA_SUCCESS)
            return cu_fail("cuMemAddressReserve", r);
        *base = (uintptr_t)p;
        return KVC_OK;
    }
    (void)alignment; /* mmap is page aligned; host pages need no more */
    void *p = mmap(NULL, (size_t)size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) {
        int e = errno;
        return kvc_fail(e == ENOMEM ? KVC_ERR_NO_MEMORY : KVC_ERR_SYSTEM,
                        "reserving %llu bytes of address space: %s", (unsigned long long)size,
                        strerror(e));
    }
    *base = (uintptr_t)p;
    return KVC_OK;
}

kvc_status kvc_mapper_release(kvc_mapper *m, uintptr_t base, uint64_t size)
{
    if (m->cuda) {
        CU_CURRENT(m);
        CU_CHECK("cuMemAddressFree", g_cu.MemAddressFree((CUdeviceptr)base, (size_t)size));
        return KVC_OK;
    }
    if (munmap((void *)base, (size_t)size) != 0)
        return kvc_fail(KVC_ERR_SYSTEM, "munmap: %s", strerror(errno));
    return KVC_OK;
}

kvc_status kvc_mapper_map(kvc_mapper *m, uintptr_t addr, int fd, uint64_t size)
{
    if (m->cuda) {
        CUresult r = g_cu.CtxSetCurrent(m->ctx);
        if (r != CUDA_SUCCESS) {
            close(fd);
            return cu_fail("cuCtxSetCurrent", r);
        }
        CUmemGenericAllocationHandle h = 0;
        /* The fd travels BY VALUE in the void* argument. */
        r = g_cu.MemImportFromShareableHandle(&h, (void *)(uintptr_t)fd,
                                              CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        close(fd);
        if (r != CUDA_SUCCESS)
            return cu_fail("cuMemImportFromShareableHandle", r);
        r = g_cu.MemMap((CUdeviceptr)addr, (size_t)size, 0, h, 0);
        if (r != CUDA_SUCCESS) {
            g_cu.MemRelease(h);
            return cu_fail("cuMemMap", r);
        }
        CUmemAccessDesc desc;
        memset(&desc, 0, sizeof desc);
        desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        desc.location.id = m->ordinal;
        desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        r = g_cu.MemSetAccess((CUdeviceptr)addr, (size_t)size, &desc, 1);
        if (r != CUDA_SUCCESS) {
            g_cu.MemUnmap((CUdeviceptr)addr, (size_t)size);
            g_cu.MemRelease(h);
            return cu_fail("cuMemSetAccess", r);
        }
        /* The mapping keeps the page alive. */
        r = g_cu.MemRelease(h);
        if (r != CUDA_SUCCESS) {
            g_cu.MemUnmap((CUdeviceptr)addr, (size_t)size);
            return cu_fail("cuMemRelease", r);
        }
        return KVC_OK;
    }
    void *p = mmap((void *)addr, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd,
                   0);
    int e = errno;
    close(fd);
    if (p == MAP_FAILED)
        return kvc_fail(KVC_ERR_SYSTEM, "mapping a page: %s", strerror(e));
    return KVC_OK;
}

kvc_status kvc_mapper_unmap(kvc_mapper *m, uintptr_t addr, uint64_t size)
{
    if (m->cuda) {
        CU_CURRENT(m);
        CU_CHECK("cuMemUnmap", g_cu.MemUnmap((CUdeviceptr)addr, (size_t)size));
        return KVC_OK;
    }
    void *p = mmap((void *)addr, (size_t)size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
        return kvc_fail(KVC_ERR_SYSTEM, "unmapping a page: %s", strerror(errno));
    return KVC_OK;
}

kvc_status kvc_mapper_memset(kvc_mapper *m, uintptr_t addr, uint8_t value, uint64_t size)
{
    if (m->cuda) {
        CU_CURRENT(m);
        CU_CHECK("cuMemsetD8_v2", g_cu.MemsetD8((CUdeviceptr)addr, value, (size_t)size));
        return KVC_OK;
    }
    memset((void *)addr, value, (size_t)size);
    return KVC_OK;
}

kvc_status kvc_mapper_write(kvc_mapper *m, uintptr_t addr, const void *src, uint64_t size)
{
    if (m->cuda) {
        CU_CURRENT(m);
        CU_CHECK("cuMemcpyHtoD_v2", g_cu.MemcpyHtoD((CUdeviceptr)addr, src, (size_t)size));
        return KVC_OK;
    }
    memcpy((void *)addr, src, (size_t)size);
    return KVC_OK;
}

kvc_status kvc_mapper_read(kvc_mapper *m, uintptr_t addr, void *dst, uint64_t size)
{
    if (m->cuda) {
        CU_CURRENT(m);
        CU_CHECK("cuMemcpyDtoH_v2", g_cu.MemcpyDtoH(dst, (CUdeviceptr)addr, (size_t)size));
        return KVC_OK;
    }
    memcpy(dst, (const void *)addr, (size_t)size);
    return KVC_OK;
}

kvc_status kvc_mapper_sync(kvc_mapper *m)
{
    if (m->cuda && g_cu.CtxSynchronize) {
        CU_CURRENT(m);
        CU_CHECK("cuCtxSynchronize", g_cu.CtxSynchronize());
    }
    return KVC_OK;
}
