/* How pages are mapped into this process, behind one table of operations
 * per device kind (as ggml-backend's buffer interfaces): mapper_host.c maps
 * memfd pages with mmap, mapper_cuda.c maps CUDA pages through the driver's
 * VMM API (loaded with dlopen). The kind the daemon names for a device
 * ("host", "cuda") picks the table in one place, the registry in mapper.c;
 * a new backend is its own file plus one line there. Plain C, internal to
 * libkvcached. Errors are recorded with kvc_fail. */
#ifndef KVC_MAPPER_H
#define KVC_MAPPER_H

#include <stddef.h>
#include <stdint.h>

#include "kvcached.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvc_mapper kvc_mapper;

/* A backend's operations. Every one is required but map_run (NULL:
 * kvc_mapper_map_run maps page by page with map). */
struct kvc_mapper_ops {
    /* A mapper for the device whose UUID is `uuid` (as the daemon names it). */
    kvc_status (*create)(const char *uuid, kvc_mapper **out);
    void (*destroy)(kvc_mapper *m);
    /* Address space for `size` bytes, aligned for pages of `alignment`
     * bytes, with nothing mapped in it. */
    kvc_status (*reserve)(kvc_mapper *m, uint64_t size, uint64_t alignment, uintptr_t *base);
    kvc_status (*release)(kvc_mapper *m, uintptr_t base, uint64_t size);
    /* Map the page behind `fd` (of `size` bytes) at addr; the fd is closed in
     * every case. */
    kvc_status (*map)(kvc_mapper *m, uintptr_t addr, int fd, uint64_t size);
    /* Unmap [addr, addr+size): one page, or a run of adjacent pages (each
     * a whole mapping: map, map_run or map_local made it) with one call;
     * regions unmap each run they give back so (CUDA: one cuMemUnmap over
     * the run's mappings, host: one mmap of PROT_NONE), and a run refused
     * page by page. Nothing is kept per address (kept handles are by id). */
    kvc_status (*unmap)(kvc_mapper *m, uintptr_t addr, uint64_t size);
    /* Map n pages of `page` bytes, fds[i] at addr + i * page, all or
     * nothing; every fd is closed in every case. For a backend whose cost
     * per call beats its cost per byte (CUDA: one cuMemSetAccess over the
     * run instead of one per page). */
    kvc_status (*map_run)(kvc_mapper *m, uintptr_t addr, const int *fds, size_t n, uint64_t page);
    /* Back [addr, addr+size) (one page) with memory of this process's own,
     * not the daemon's, reading as zeros; unmap frees it. */
    kvc_status (*map_local)(kvc_mapper *m, uintptr_t addr, uint64_t size);
    kvc_status (*memset)(kvc_mapper *m, uintptr_t addr, uint8_t value, uint64_t size);
    kvc_status (*write)(kvc_mapper *m, uintptr_t addr, const void *src, uint64_t size);
    kvc_status (*read)(kvc_mapper *m, uintptr_t addr, void *dst, uint64_t size);
    /* Wait for the memsets/copies issued so far. */
    kvc_status (*sync)(kvc_mapper *m);

    /* Kept handles (docs/protocol.md "Kept handles"): optional, all NULL
     * for a backend whose pages are never kept (host: a mapping costs one
     * mmap either way). The mapper is its session's, so the cache is per
     * session, keyed by page id; every op is thread-safe (the session's
     * reader answers DROP while other threads map).
     * map_run_ids: map_run, knowing the pages' ids: a page whose handle is
     * kept is mapped from it (its fd closed: no import), one imported is
     * kept instead of released while fewer than the limit are kept. */
    kvc_status (*map_run_ids)(kvc_mapper *m, uintptr_t addr, const uint64_t *ids, const int *fds,
                              size_t n, uint64_t page);
    /* Release every kept handle, then keep up to `limit` (0: never keep). */
    void (*keep_reset)(kvc_mapper *m, size_t limit);
    /* How many of these pages have a kept handle. */
    size_t (*kept)(kvc_mapper *m, const uint64_t *ids, size_t n);
    /* Release the kept handles of these pages (others are nothing to it);
     * returns how many there were. */
    size_t (*drop)(kvc_mapper *m, const uint64_t *ids, size_t n);
    /* How many handles are kept now. */
    size_t (*kept_total)(kvc_mapper *m);
};

/* Every backend's mapper starts with this (its own state follows). */
struct kvc_mapper {
    const struct kvc_mapper_ops *ops;
};

/* The backends (mapper_<kind>.c), registered by kind in mapper.c. */
/* Host pages: reservations are PROT_NONE anonymous mappings; a page is
 * mapped over its slot with MAP_FIXED|MAP_SHARED, unmapped by putting
 * PROT_NONE back; a local page is an anonymous private mapping there. */
extern const struct kvc_mapper_ops kvc_mapper_host_ops;
/* CUDA pages of the device whose UUID is "GPU-xxxxxxxx-...": create loads
 * $KVCACHED_LIBCUDA (default libcuda.so.1), cuInit, finds the local ordinal
 * by cuDeviceGetUuid_v2, retains its primary context. */
extern const struct kvc_mapper_ops kvc_mapper_cuda_ops;

/* The operations for devices of this kind, or NULL for a kind no backend
 * serves. */
const struct kvc_mapper_ops *kvc_mapper_ops_for(const char *kind);

/* A mapper for device `uuid` of this kind (KVC_ERR_PROTOCOL for a kind no
 * backend serves). */
kvc_status kvc_mapper_create(const char *kind, const char *uuid, kvc_mapper **out);

void kvc_mapper_destroy(kvc_mapper *m);
kvc_status kvc_mapper_reserve(kvc_mapper *m, uint64_t size, uint64_t alignment, uintptr_t *base);
kvc_status kvc_mapper_release(kvc_mapper *m, uintptr_t base, uint64_t size);
kvc_status kvc_mapper_unmap(kvc_mapper *m, uintptr_t addr, uint64_t size);
kvc_status kvc_mapper_map_run(kvc_mapper *m, uintptr_t addr, const int *fds, size_t n, uint64_t page);
/* map_run with the pages' ids (kept handles); map_run where the backend keeps none. */
kvc_status kvc_mapper_map_run_ids(kvc_mapper *m, uintptr_t addr, const uint64_t *ids,
                                  const int *fds, size_t n, uint64_t page);
/* Kept handles (see the ops); no-ops (0) for a backend that keeps none. */
void kvc_mapper_keep_reset(kvc_mapper *m, size_t limit);
size_t kvc_mapper_kept(kvc_mapper *m, const uint64_t *ids, size_t n);
size_t kvc_mapper_drop(kvc_mapper *m, const uint64_t *ids, size_t n);
size_t kvc_mapper_kept_total(kvc_mapper *m);
kvc_status kvc_mapper_map_local(kvc_mapper *m, uintptr_t addr, uint64_t size);
kvc_status kvc_mapper_memset(kvc_mapper *m, uintptr_t addr, uint8_t value, uint64_t size);
kvc_status kvc_mapper_write(kvc_mapper *m, uintptr_t addr, const void *src, uint64_t size);
kvc_status kvc_mapper_read(kvc_mapper *m, uintptr_t addr, void *dst, uint64_t size);
kvc_status kvc_mapper_sync(kvc_mapper *m);

/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" from 16 UUID bytes. */
void kvc_format_gpu_uuid(const unsigned char bytes[16], char out[41]);

#ifdef __cplusplus
}
#endif

#endif
