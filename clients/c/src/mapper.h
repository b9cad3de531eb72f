/* How pages are mapped into this process: host memfd pages through mmap,
 * CUDA pages through the driver's VMM API (loaded with dlopen). Plain C,
 * internal to libkvcached. Errors are recorded with kvc_fail. */
#ifndef KVC_MAPPER_H
#define KVC_MAPPER_H

#include <stddef.h>
#include <stdint.h>

#include "kvcached.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvc_mapper kvc_mapper;

/* Host pages: reservations are PROT_NONE anonymous mappings; a page is
 * mapped over its slot with MAP_FIXED|MAP_SHARED, unmapped by putting
 * PROT_NONE back. */
kvc_status kvc_mapper_create_host(kvc_mapper **out);

/* CUDA pages of the device whose UUID is `uuid` ("GPU-xxxxxxxx-..."): loads
 * $KVCACHED_LIBCUDA (default libcuda.so.1), cuInit, finds the local ordinal
 * by cuDeviceGetUuid_v2, retains its primary context. */
kvc_status kvc_mapper_create_cuda(const char *uuid, kvc_mapper **out);

void kvc_mapper_destroy(kvc_mapper *m);

int kvc_mapper_is_cuda(const kvc_mapper *m);
int kvc_mapper_ordinal(const kvc_mapper *m);

kvc_status kvc_mapper_reserve(kvc_mapper *m, uint64_t size, uint64_t alignment, uintptr_t *base);
kvc_status kvc_mapper_release(kvc_mapper *m, uintptr_t base, uint64_t size);
/* Map the page behind `fd` (of `size` bytes) at addr; the fd is closed in
 * every case. */
kvc_status kvc_mapper_map(kvc_mapper *m, uintptr_t addr, int fd, uint64_t size);
kvc_status kvc_mapper_unmap(kvc_mapper *m, uintptr_t addr, uint64_t size);
kvc_status kvc_mapper_memset(kvc_mapper *m, uintptr_t addr, uint8_t value, uint64_t size);
kvc_status kvc_mapper_write(kvc_mapper *m, uintptr_t addr, const void *src, uint64_t size);
kvc_status kvc_mapper_read(kvc_mapper *m, uintptr_t addr, void *dst, uint64_t size);
/* Wait for the memsets/copies issued so far (cuCtxSynchronize; no-op on host). */
kvc_status kvc_mapper_sync(kvc_mapper *m);

/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" from 16 UUID bytes. */
void kvc_format_gpu_uuid(const unsigned char bytes[16], char out[41]);

#ifdef __cplusplus
}
#endif

#endif
