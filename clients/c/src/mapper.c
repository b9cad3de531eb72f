/* Page mapping: the registry of backends by device kind, and the calls that
 * go through a mapper's operations. */
#include "mapper.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "status.h"

/* The backends by the kind the daemon gives its devices (GetInfo's
 * DeviceInfo.kind). */
static const struct {
    const char *kind;
    const struct kvc_mapper_ops *ops;
} g_backends[] = {
    {"host", &kvc_mapper_host_ops},
    {"cuda", &kvc_mapper_cuda_ops},
};

const struct kvc_mapper_ops *kvc_mapper_ops_for(const char *kind)
{
    for (size_t i = 0; i < sizeof g_backends / sizeof g_backends[0]; i++)
        if (strcmp(g_backends[i].kind, kind) == 0)
            return g_backends[i].ops;
    return NULL;
}

kvc_status kvc_mapper_create(const char *kind, const char *uuid, kvc_mapper **out)
{
    const struct kvc_mapper_ops *ops = kvc_mapper_ops_for(kind);
    if (!ops)
        return kvc_fail(KVC_ERR_PROTOCOL, "device %s has unknown kind \"%s\"", uuid, kind);
    kvc_status st = ops->create(uuid, out);
    if (st == KVC_OK)
        (*out)->ops = ops;
    return st;
}

void kvc_mapper_destroy(kvc_mapper *m)
{
    if (m)
        m->ops->destroy(m);
}

kvc_status kvc_mapper_reserve(kvc_mapper *m, uint64_t size, uint64_t alignment, uintptr_t *base)
{
    return m->ops->reserve(m, size, alignment, base);
}

kvc_status kvc_mapper_release(kvc_mapper *m, uintptr_t base, uint64_t size)
{
    return m->ops->release(m, base, size);
}

kvc_status kvc_mapper_unmap(kvc_mapper *m, uintptr_t addr, uint64_t size)
{
    return m->ops->unmap(m, addr, size);
}

kvc_status kvc_mapper_map_run(kvc_mapper *m, uintptr_t addr, const int *fds, size_t n, uint64_t page)
{
    if (m->ops->map_run)
        return m->ops->map_run(m, addr, fds, n, page);
    for (size_t i = 0; i < n; i++) {
        kvc_status st = m->ops->map(m, addr + i * page, fds[i], page);
        if (st != KVC_OK) {
            char msg[1024];
            snprintf(msg, sizeof msg, "%s", kvc_last_error());
            for (size_t j = i + 1; j < n; j++)
                close(fds[j]);
            if (i > 0)
                m->ops->unmap(m, addr, i * page); /* the pages mapped so far: one run */
            return kvc_fail(st, "%s", msg);
        }
    }
    return KVC_OK;
}

kvc_status kvc_mapper_map_run_ids(kvc_mapper *m, uintptr_t addr, const uint64_t *ids,
                                  const int *fds, size_t n, uint64_t page)
{
    if (m->ops->map_run_ids && ids)
        return m->ops->map_run_ids(m, addr, ids, fds, n, page);
    return kvc_mapper_map_run(m, addr, fds, n, page);
}

void kvc_mapper_keep_reset(kvc_mapper *m, size_t limit)
{
    if (m && m->ops->keep_reset)
        m->ops->keep_reset(m, limit);
}

size_t kvc_mapper_kept(kvc_mapper *m, const uint64_t *ids, size_t n)
{
    return m && m->ops->kept && n ? m->ops->kept(m, ids, n) : 0;
}

size_t kvc_mapper_drop(kvc_mapper *m, const uint64_t *ids, size_t n)
{
    return m && m->ops->drop && n ? m->ops->drop(m, ids, n) : 0;
}

size_t kvc_mapper_kept_total(kvc_mapper *m)
{
    return m && m->ops->kept_total ? m->ops->kept_total(m) : 0;
}

kvc_status kvc_mapper_map_local(kvc_mapper *m, uintptr_t addr, uint64_t size)
{
    return m->ops->map_local(m, addr, size);
}

kvc_status kvc_mapper_memset(kvc_mapper *m, uintptr_t addr, uint8_t value, uint64_t size)
{
    return m->ops->memset(m, addr, value, size);
}

kvc_status kvc_mapper_write(kvc_mapper *m, uintptr_t addr, const void *src, uint64_t size)
{
    return m->ops->write(m, addr, src, size);
}

kvc_status kvc_mapper_read(kvc_mapper *m, uintptr_t addr, void *dst, uint64_t size)
{
    return m->ops->read(m, addr, dst, size);
}

kvc_status kvc_mapper_sync(kvc_mapper *m)
{
    return m->ops->sync(m);
}

void kvc_format_gpu_uuid(const unsigned char b[16], char out[41])
{
    snprintf(out, 41,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
             b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
             b[14], b[15]);
}
