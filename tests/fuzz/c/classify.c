/* The C client's fd channel decoder as a shared library for the Python
 * fdchannel fuzz target's differential check (tests/fuzz/targets.py): each
 * input decoded by kvc_fd_decode_any here must get the same answer as from
 * kvcached_service/fdchannel.py (status class, req_id, type, page count,
 * and a malformed request's REPLY message). Built by scripts/test-fuzz.sh
 * (gcc -shared) into build/fuzz/c/libkvcfd.so. Not thread-safe. */
#include <stdint.h>

#include "fdchannel.h"

static kvc_fd_record rec;
static char err[512];

const char *kvc_fuzz_err(void) { return err; }

int kvc_fuzz_classify(const uint8_t *buf, size_t len, size_t nfds, uint64_t *req, uint32_t *type,
                      uint32_t *count)
{
    int fds[256];
    for (size_t i = 0; i < nfds && i < 256; i++)
        fds[i] = 1000 + (int)i;
    err[0] = 0;
    *req = 0;
    kvc_status st = kvc_fd_decode_any(buf, len, fds, nfds < 256 ? nfds : 256, &rec, req, err, sizeof err);
    *type = rec.type;
    *count = rec.count;
    return (int)st;
}
