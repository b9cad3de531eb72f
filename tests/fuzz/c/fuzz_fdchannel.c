/* libFuzzer target: the C client's fd channel decoder (clients/c/src/fdchannel.c),
 * kvc_fd_decode_any (either direction, as the codec tests and fake daemons use
 * it) and kvc_fd_decode (what a client does with a received record).
 * Input: [nfds u8][flags u8][record] (tests/fuzz/targets.py; flags unused here).
 * Built and run by scripts/test-fuzz.sh with -fsanitize=fuzzer,address,undefined;
 * docs/fuzzing.md. Beyond ASan/UBSan it checks the decoder's contract: only
 * KVC_OK, KVC_ERR_PROTOCOL or (decode_any) KVC_ERR_INVALID_ARGUMENT; an error
 * names its fault; strings are NUL-terminated within their fields; counts and
 * descriptors within the record's limits. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fdchannel.h"

static kvc_fd_record rec; /* ~150 KiB: not on the stack, and not per input */

#define CHECK(cond, ...)                                         \
    do {                                                         \
        if (!(cond)) {                                           \
            fprintf(stderr, "fuzz_fdchannel: " __VA_ARGS__);     \
            fprintf(stderr, " (%s)\n", #cond);                   \
            abort();                                             \
        }                                                        \
    } while (0)

static void check_record(const kvc_fd_record *r, size_t nfds, const int *fds)
{
    CHECK(memchr(r->message, 0, sizeof r->message) != NULL, "message not NUL-terminated");
    CHECK(memchr(r->device, 0, sizeof r->device) != NULL, "device not NUL-terminated");
    CHECK(memchr(r->reason, 0, sizeof r->reason) != NULL, "reason not NUL-terminated");
    CHECK(r->num_fds <= KVC_FD_MAX_FDS && r->num_fds <= nfds, "num_fds %u of %zu", r->num_fds, nfds);
    for (uint32_t i = 0; i < r->num_fds; i++)
        CHECK(r->fds[i] == fds[i], "fd %u", i);
    if (r->type == KVC_FD_PAGES || r->type == KVC_FD_ADOPT)
        CHECK(r->count >= 1 && r->count <= KVC_FD_MAX_FDS && r->count == r->num_fds &&
                  (uint64_t)r->first_index + r->count <= r->total,
              "PAGES count %u first %u total %u", r->count, r->first_index, r->total);
    if (r->type == KVC_FD_FREE || r->type == KVC_FD_DROPPED || r->type == KVC_FD_USE ||
        r->type == KVC_FD_DROP) {
        CHECK(r->count <= KVC_FD_MAX_FREE_IDS, "%u ids", r->count);
        uint64_t sum = 0; /* read every id: ASan checks free_ids lies inside the input */
        for (uint32_t i = 0; i < r->count; i++)
            sum += kvc_fd_record_id(r, i);
        (void)sum;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2)
        return 0;
    size_t nfds = data[0];
    int fds[256];
    for (size_t i = 0; i < nfds; i++)
        fds[i] = 1000 + (int)i; /* never opened: the decoder only copies them */
    /* the record in a buffer of its own exact size, so that ASan sees any read past it */
    size_t len = size - 2;
    uint8_t *buf = malloc(len ? len : 1);
    memcpy(buf, data + 2, len);
    char err[512];
    uint64_t req = 0;

    err[0] = 0;
    kvc_status st = kvc_fd_decode_any(buf, len, fds, nfds, &rec, &req, err, sizeof err);
    CHECK(st == KVC_OK || st == KVC_ERR_PROTOCOL || st == KVC_ERR_INVALID_ARGUMENT, "status %d", (int)st);
    if (st == KVC_OK)
        check_record(&rec, nfds, fds);
    else
        CHECK(err[0] != 0 && memchr(err, 0, sizeof err) != NULL, "an error without a message");
    if (st == KVC_ERR_INVALID_ARGUMENT)
        CHECK(strncmp(err, "malformed ", 10) == 0 && len >= KVC_FD_HEADER_SIZE + 8, "malformed request: %s", err);

    err[0] = 0;
    st = kvc_fd_decode(buf, len, fds, nfds, &rec, err, sizeof err);
    CHECK(st == KVC_OK || st == KVC_ERR_PROTOCOL, "client decode status %d", (int)st);
    if (st == KVC_OK) {
        check_record(&rec, nfds, fds);
        CHECK(rec.type == KVC_FD_HELLO || rec.type == KVC_FD_PAGES || rec.type == KVC_FD_ERROR ||
                  rec.type == KVC_FD_GOODBYE || rec.type == KVC_FD_REPLY || rec.type == KVC_FD_DROP,
              "a client accepted type %u", rec.type);
    } else {
        CHECK(err[0] != 0, "an error without a message");
    }
    /* a short error buffer must be cut, not overrun */
    char small[8];
    (void)kvc_fd_decode_any(buf, len, fds, nfds, &rec, &req, small, sizeof small);
    free(buf);
    return 0;
}
