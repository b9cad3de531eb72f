/* Host pages (memfd, from the daemon's host backend): mmap. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "mapper.h"
#include "status.h"

static kvc_status host_create(const char *uuid, kvc_mapper **out)
{
    (void)uuid; /* one host device */
    kvc_mapper *m = calloc(1, sizeof *m);
    if (!m)
        return kvc_fail(KVC_ERR_NO_MEMORY, "out of memory");
    *out = m;
    return KVC_OK;
}

static void host_destroy(kvc_mapper *m) { free(m); }

static kvc_status host_reserve(kvc_mapper *m, uint64_t size, uint64_t alignment, uintptr_t *base)
{
    (void)m;
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

static kvc_status host_release(kvc_mapper *m, uintptr_t base, uint64_t size)
{
    (void)m;
    if (munmap((void *)base, (size_t)size) != 0)
        return kvc_fail(KVC_ERR_SYSTEM, "munmap: %s", strerror(errno));
    return KVC_OK;
}

static kvc_status host_map(kvc_mapper *m, uintptr_t addr, int fd, uint64_t size)
{
    (void)m;
    void *p = mmap((void *)addr, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd,
                   0);
    int e = errno;
    close(fd);
    if (p == MAP_FAILED)
        return kvc_fail(KVC_ERR_SYSTEM, "mapping a page: %s", strerror(e));
    return KVC_OK;
}

/* One page or a run of adjacent ones: PROT_NONE anonymous memory over the range. */
static kvc_status host_unmap(kvc_mapper *m, uintptr_t addr, uint64_t size)
{
    (void)m;
    void *p = mmap((void *)addr, (size_t)size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
        return kvc_fail(KVC_ERR_SYSTEM, "unmapping %llu bytes: %s", (unsigned long long)size,
                        strerror(errno));
    return KVC_OK;
}

static kvc_status host_map_local(kvc_mapper *m, uintptr_t addr, uint64_t size)
{
    (void)m;
    void *p = mmap((void *)addr, (size_t)size, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (p == MAP_FAILED) {
        int e = errno;
        return kvc_fail(e == ENOMEM ? KVC_ERR_NO_MEMORY : KVC_ERR_SYSTEM,
                        "mapping a local page: %s", strerror(e));
    }
    return KVC_OK;
}

static kvc_status host_memset(kvc_mapper *m, uintptr_t addr, uint8_t value, uint64_t size)
{
    (void)m;
    memset((void *)addr, value, (size_t)size);
    return KVC_OK;
}

static kvc_status host_write(kvc_mapper *m, uintptr_t addr, const void *src, uint64_t size)
{
    (void)m;
    memcpy((void *)addr, src, (size_t)size);
    return KVC_OK;
}

static kvc_status host_read(kvc_mapper *m, uintptr_t addr, void *dst, uint64_t size)
{
    (void)m;
    memcpy(dst, (const void *)addr, (size_t)size);
    return KVC_OK;
}

static kvc_status host_sync(kvc_mapper *m)
{
    (void)m; /* plain stores: nothing to wait for */
    return KVC_OK;
}

const struct kvc_mapper_ops kvc_mapper_host_ops = {
    .create = host_create,
    .destroy = host_destroy,
    .reserve = host_reserve,
    .release = host_release,
    .map = host_map,
    .unmap = host_unmap,
    .map_run = NULL, /* page by page: mmap costs the same either way */
    .map_local = host_map_local,
    .memset = host_memset,
    .write = host_write,
    .read = host_read,
    .sync = host_sync,
};
