/* fd channel framing: byte vectors from docs/protocol.md, decoding of
 * malformed records, and SCM_RIGHTS transport over a socketpair. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fdchannel.h"

static int failures;
#define CHECK(cond)                                                            \
    do {                                                                       \
        if (!(cond)) {                                                         \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            failures++;                                                        \
        }                                                                      \
    } while (0)

static kvc_fd_record rec;
static char err[512];

static void test_hello_vector(void)
{
    uint8_t secret[32];
    for (int i = 0; i < 32; i++)
        secret[i] = (uint8_t)(0xA0 + i);
    uint8_t buf[256];
    size_t n = kvc_fd_encode_hello(buf, sizeof buf, 0x0102030405060708ull, 1234, 1000, 100, 253,
                                   secret);
    /* header: magic 'K','V','C','F', version 1, type 1, payload_len 56, reserved 0 */
    static const uint8_t want[] = {
        'K', 'V', 'C', 'F', 0x01, 0x00, 0x01, 0x00, 0x38, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01, /* channel_id u64 */
        0xD2, 0x04, 0x00, 0x00,                         /* pid 1234 */
        0xE8, 0x03, 0x00, 0x00,                         /* uid 1000 */
        0x64, 0x00, 0x00, 0x00,                         /* gid 100 */
        0xFD, 0x00, 0x00, 0x00,                         /* max_fds 253 */
    };
    CHECK(n == 16 + 56);
    CHECK(memcmp(buf, want, sizeof want) == 0);
    CHECK(memcmp(buf + sizeof want, secret, 32) == 0);
    CHECK(kvc_fd_decode(buf, n, NULL, 0, &rec, err, sizeof err) == KVC_OK);
    CHECK(rec.type == KVC_FD_HELLO && rec.channel_id == 0x0102030405060708ull && rec.pid == 1234 &&
          rec.uid == 1000 && rec.gid == 100 && rec.max_fds == 253 &&
          memcmp(rec.secret, secret, 32) == 0);
    /* a HELLO never carries fds */
    int fake = 99;
    CHECK(kvc_fd_decode(buf, n, &fake, 1, &rec, err, sizeof err) == KVC_ERR_PROTOCOL);
}

static void test_pages_vector(void)
{
    uint64_t ids[2] = {7, 0x1122334455667788ull};
    uint8_t buf[256];
    size_t n = kvc_fd_encode_pages(buf, sizeof buf, 42, 253, 255, ids, 2);
    static const uint8_t want[] = {
        'K', 'V', 'C', 'F', 0x01, 0x00, 0x02, 0x00, 0x28, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        42, 0, 0, 0, 0, 0, 0, 0, /* allocation_id */
        0xFD, 0, 0, 0,           /* first_index 253 */
        2, 0, 0, 0,              /* count */
        0xFF, 0, 0, 0,           /* total 255 */
        0, 0, 0, 0,              /* reserved */
        7, 0, 0, 0, 0, 0, 0, 0,
        0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11,
    };
    CHECK(n == sizeof want);
    CHECK(memcmp(buf, want, sizeof want) == 0);
    int fds[2] = {10, 11};
    CHECK(kvc_fd_decode(buf, n, fds, 2, &rec, err, sizeof err) == KVC_OK);
    CHECK(rec.type == KVC_FD_PAGES && rec.allocation_id == 42 && rec.first_index == 253 &&
          rec.count == 2 && rec.total == 255 && rec.page_ids[1] == 0x1122334455667788ull &&
          rec.fds[0] == 10 && rec.fds[1] == 11 && rec.num_fds == 2);
    /* count and fds must agree */
    CHECK(kvc_fd_decode(buf, n, fds, 1, &rec, err, sizeof err) == KVC_ERR_PROTOCOL);
    CHECK(strstr(err, "2 pages") != NULL);
    /* pages past the allocation */
    n = kvc_fd_encode_pages(buf, sizeof buf, 42, 254, 255, ids, 2);
    CHECK(kvc_fd_decode(buf, n, fds, 2, &rec, err, sizeof err) == KVC_ERR_PROTOCOL);
    /* encoder limits */
    CHECK(kvc_fd_encode_pages(buf, sizeof buf, 1, 0, 1, ids, 0) == 0);
    CHECK(kvc_fd_encode_pages(buf, 20, 1, 0, 2, ids, 2) == 0);
}

/* ADOPT (type 5): the PAGES layout with the session id first. */
static void test_adopt_vector(void)
{
    uint8_t buf[256];
    uint64_t ids[2] = {7, 0x1122334455667788ull};
    size_t n = kvc_fd_encode_adopt(buf, sizeof buf, 9, 0, 2, ids, 2);
    static const uint8_t want[] = {
        'K', 'V', 'C', 'F', 0x01, 0x00, 0x05, 0x00, 0x28, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        9, 0, 0, 0, 0, 0, 0, 0,  /* session_id */
        0, 0, 0, 0,              /* first_index */
        2, 0, 0, 0,              /* count */
        2, 0, 0, 0,              /* total */
        0, 0, 0, 0,              /* reserved */
        7, 0, 0, 0, 0, 0, 0, 0,
        0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11,
    };
    CHECK(n == sizeof want);
    CHECK(memcmp(buf, want, sizeof want) == 0);
    CHECK(kvc_fd_encode_adopt(buf, sizeof buf, 9, 0, 1, ids, 0) == 0);
}

static void test_error_goodbye_vectors(void)
{
    uint8_t buf[256];
    size_t n = kvc_fd_encode_error(buf, sizeof buf, 8, "budget");
    static const uint8_t want[] = {'K', 'V', 'C', 'F', 1, 0, 3, 0, 10, 0, 0, 0, 0, 0, 0, 0,
                                   8,   0,   0,   0,   'b', 'u', 'd', 'g', 'e', 't'};
    CHECK(n == sizeof want && memcmp(buf, want, n) == 0);
    CHECK(kvc_fd_decode(buf, n, NULL, 0, &rec, err, sizeof err) == KVC_OK);
    CHECK(rec.type == KVC_FD_ERROR && rec.error_code == 8 && strcmp(rec.message, "budget") == 0);
    n = kvc_fd_encode_goodbye(buf, sizeof buf);
    static const uint8_t bye[] = {'K', 'V', 'C', 'F', 1, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    CHECK(n == 16 && memcmp(buf, bye, 16) == 0);
    CHECK(kvc_fd_decode(buf, n, NULL, 0, &rec, err, sizeof err) == KVC_OK);
    CHECK(rec.type == KVC_FD_GOODBYE);
}

static void test_malformed(void)
{
    uint8_t buf[256];
    size_t n = kvc_fd_encode_goodbye(buf, sizeof buf);
    CHECK(kvc_fd_decode(buf, 15, NULL, 0, &rec, err, sizeof err) == KVC_ERR_PROTOCOL);
    buf[0] = 'X';
    CHECK(kvc_fd_decode(buf, n, NULL, 0, &rec, err, sizeof err) == KVC_ERR_PROTOCOL);
    CHECK(strstr(err, "magic") != NULL);
    n = kvc_fd_encode_goodbye(buf, sizeof buf);
    buf[4] = 2; /* version */
    CHECK(kvc_fd_decode(buf, n, NULL, 0, &rec, err, sizeof err) == KVC_ERR_PROTOCOL);
    CHECK(strstr(err, "version") != NULL);
    n = kvc_fd_encode_goodbye(buf, sizeof buf);
    buf[6] = 9; /* type */
    CHECK(kvc_fd_decode(buf, n, NULL, 0, &rec, err, sizeof err) == KVC_ERR_PROTOCOL);
    n = kvc_fd_encode_goodbye(buf, sizeof buf);
    buf[8] = 1; /* payload_len says 1, record has 0 */
    CHECK(kvc_fd_decode(buf, n, NULL, 0, &rec, err, sizeof err) == KVC_ERR_PROTOCOL);
    CHECK(strstr(err, "header says 1") != NULL);
}

static int memfd_with(const char *text)
{
    int fd = memfd_create("kvc-test", MFD_CLOEXEC);
    if (fd < 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text))
        abort();
    return fd;
}

static void test_transport(void)
{
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) == 0);
    uint8_t buf[KVC_FD_MAX_RECORD];
    int eof = 0;

    /* 253 fds in one record */
    enum { N = KVC_FD_MAX_FDS };
    uint64_t ids[N];
    int fds[N];
    for (int i = 0; i < N; i++) {
        char t[32];
        snprintf(t, sizeof t, "page-%d", i);
        ids[i] = 1000 + i;
        fds[i] = memfd_with(t);
    }
    size_t n = kvc_fd_encode_pages(buf, sizeof buf, 5, 0, N, ids, N);
    CHECK(kvc_fd_send(sv[0], buf, n, fds, N, err, sizeof err) == KVC_OK);
    for (int i = 0; i < N; i++)
        close(fds[i]);
    CHECK(kvc_fd_recv(sv[1], 1000, &rec, &eof, err, sizeof err) == KVC_OK);
    CHECK(!eof && rec.type == KVC_FD_PAGES && rec.count == N && rec.num_fds == N);
    for (int i = 0; i < (int)rec.num_fds; i++) {
        char t[32], got[32] = {0};
        snprintf(t, sizeof t, "page-%d", i);
        CHECK(pread(rec.fds[i], got, sizeof got - 1, 0) == (ssize_t)strlen(t));
        CHECK(strcmp(got, t) == 0);
        CHECK(fcntl(rec.fds[i], F_GETFD) & FD_CLOEXEC); /* MSG_CMSG_CLOEXEC */
    }
    kvc_fd_record_close_fds(&rec);

    /* a malformed record with fds: its fds are closed, PROTOCOL returned */
    int fd = memfd_with("x");
    n = kvc_fd_encode_pages(buf, sizeof buf, 6, 0, 2, ids, 2); /* says 2, carries 1 */
    CHECK(kvc_fd_send(sv[0], buf, n, &fd, 1, err, sizeof err) == KVC_OK);
    close(fd);
    int before = open("/dev/null", O_RDONLY);
    close(before);
    CHECK(kvc_fd_recv(sv[1], 1000, &rec, &eof, err, sizeof err) == KVC_ERR_PROTOCOL);
    int after = open("/dev/null", O_RDONLY);
    CHECK(after == before); /* the received fd was closed again */
    close(after);

    /* an oversized record is truncated: PROTOCOL */
    static uint8_t big[KVC_FD_MAX_RECORD + 64];
    memset(big, 0, sizeof big);
    CHECK(kvc_fd_send(sv[0], big, sizeof big, NULL, 0, err, sizeof err) == KVC_OK);
    CHECK(kvc_fd_recv(sv[1], 1000, &rec, &eof, err, sizeof err) == KVC_ERR_PROTOCOL);
    CHECK(strstr(err, "truncated") != NULL);

    /* timeout */
    CHECK(kvc_fd_recv(sv[1], 10, &rec, &eof, err, sizeof err) == KVC_ERR_DEADLINE_EXCEEDED);

    /* end of stream */
    close(sv[0]);
    CHECK(kvc_fd_recv(sv[1], 1000, &rec, &eof, err, sizeof err) == KVC_OK);
    CHECK(eof == 1);
    close(sv[1]);

    /* connecting to nothing */
    int cfd = -1;
    CHECK(kvc_fd_connect("/nonexistent/kvc.sock.fd", &cfd, err, sizeof err) ==
          KVC_ERR_UNAVAILABLE);
}

/* Requests on the channel and their REPLY. Expected bytes were produced
 * once by the daemon's encoder (kvcached_service/fdchannel.py), e.g.
 * encode_allocate(0x0102030405060708, 300, "GPU-ab", wait=True,
 * notify=True, wait_timeout_ms=2500). */
static void test_request_vectors(void)
{
    uint8_t buf[256];
    static const uint8_t alloc[] = {
        0x4b, 0x56, 0x43, 0x46, 0x01, 0x00, 0x06, 0x00, 0x1e, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01, 0x2c, 0x01, 0x00, 0x00, 0x03, 0x00,
        0x00, 0x00, 0xc4, 0x09, 0x00, 0x00, 0x06, 0x00, 0x00, 0x00, 0x47, 0x50, 0x55, 0x2d, 0x61,
        0x62};
    size_t n = kvc_fd_encode_allocate(buf, sizeof buf, 0x0102030405060708ull, 300,
                                      KVC_FD_ALLOC_WAIT | KVC_FD_ALLOC_NOTIFY, 2500, "GPU-ab");
    CHECK(n == sizeof alloc && memcmp(buf, alloc, sizeof alloc) == 0);
    /* encode_allocate(1, 16): no device, no flags */
    static const uint8_t alloc0[] = {
        0x4b, 0x56, 0x43, 0x46, 0x01, 0x00, 0x06, 0x00, 0x18, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x10, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00};
    n = kvc_fd_encode_allocate(buf, sizeof buf, 1, 16, 0, 0, NULL);
    CHECK(n == sizeof alloc0 && memcmp(buf, alloc0, sizeof alloc0) == 0);
    CHECK(kvc_fd_encode_allocate(buf, 20, 1, 16, 0, 0, "") == 0); /* does not fit */

    /* encode_free(9, [7, 0x1122334455667788]) */
    static const uint8_t fr[] = {
        0x4b, 0x56, 0x43, 0x46, 0x01, 0x00, 0x07, 0x00, 0x20, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x09, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x07, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x88, 0x77, 0x66, 0x55, 0x44,
        0x33, 0x22, 0x11};
    uint64_t ids[2] = {7, 0x1122334455667788ull};
    n = kvc_fd_encode_free(buf, sizeof buf, 9, ids, 2);
    CHECK(n == sizeof fr && memcmp(buf, fr, sizeof fr) == 0);
    CHECK(kvc_fd_encode_free(buf, sizeof buf, 9, ids, 0) == 0);
    /* the largest FREE: 16384 ids, 131104 bytes (as Python's), no more */
    static uint64_t many[KVC_FD_MAX_FREE_IDS + 1];
    static uint8_t big[KVC_FD_MAX_CLIENT_RECORD + 8];
    for (uint32_t i = 0; i <= KVC_FD_MAX_FREE_IDS; i++)
        many[i] = i + 1;
    n = kvc_fd_encode_free(big, sizeof big, 3, many, KVC_FD_MAX_FREE_IDS);
    CHECK(n == 131104 && n == KVC_FD_MAX_CLIENT_RECORD);
    CHECK(big[8] == 0x10 && big[9] == 0x00 && big[10] == 0x02 && big[11] == 0x00); /* 131088 */
    CHECK(big[24] == 0x00 && big[25] == 0x40);                                    /* count */
    CHECK(big[n - 8] == 0x00 && big[n - 7] == 0x40 && big[n - 1] == 0);           /* id 16384 */
    CHECK(kvc_fd_encode_free(big, sizeof big, 3, many, KVC_FD_MAX_FREE_IDS + 1) == 0);

    /* encode_close(0xfffffffffffffffe) */
    static const uint8_t cl[] = {0x4b, 0x56, 0x43, 0x46, 0x01, 0x00, 0x08, 0x00,
                                 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
                                 0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
    n = kvc_fd_encode_close(buf, sizeof buf, 0xfffffffffffffffeull);
    CHECK(n == sizeof cl && memcmp(buf, cl, sizeof cl) == 0);

    /* encode_reply(5, 8, 1 << 40, "no room") */
    static const uint8_t rep[] = {
        0x4b, 0x56, 0x43, 0x46, 0x01, 0x00, 0x09, 0x00, 0x1f, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x05, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x6e, 0x6f, 0x20, 0x72, 0x6f,
        0x6f, 0x6d};
    n = kvc_fd_encode_reply(buf, sizeof buf, 5, 8, 1ull << 40, "no room");
    CHECK(n == sizeof rep && memcmp(buf, rep, sizeof rep) == 0);
    CHECK(kvc_fd_decode(rep, sizeof rep, NULL, 0, &rec, err, sizeof err) == KVC_OK);
    CHECK(rec.type == KVC_FD_REPLY && rec.req_id == 5 && rec.error_code == 8 &&
          rec.value == (1ull << 40) && strcmp(rec.message, "no room") == 0);
    /* encode_reply(6, 0, 3) */
    static const uint8_t rep0[] = {
        0x4b, 0x56, 0x43, 0x46, 0x01, 0x00, 0x09, 0x00, 0x18, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x06, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00};
    n = kvc_fd_encode_reply(buf, sizeof buf, 6, 0, 3, NULL);
    CHECK(n == sizeof rep0 && memcmp(buf, rep0, sizeof rep0) == 0);
    CHECK(kvc_fd_decode(rep0, sizeof rep0, NULL, 0, &rec, err, sizeof err) == KVC_OK);
    CHECK(rec.type == KVC_FD_REPLY && rec.req_id == 6 && rec.error_code == 0 && rec.value == 3 &&
          rec.message[0] == 0);
    /* a REPLY never carries fds, and has its 24 fixed bytes */
    int fake = 99;
    CHECK(kvc_fd_decode(rep0, sizeof rep0, &fake, 1, &rec, err, sizeof err) == KVC_ERR_PROTOCOL);
    uint8_t shortrep[sizeof rep0];
    memcpy(shortrep, rep0, sizeof rep0);
    shortrep[8] = 0x10;
    CHECK(kvc_fd_decode(shortrep, 16 + 16, NULL, 0, &rec, err, sizeof err) == KVC_ERR_PROTOCOL);
    /* requests are the client's to send, never to receive */
    CHECK(kvc_fd_decode(cl, sizeof cl, NULL, 0, &rec, err, sizeof err) == KVC_ERR_PROTOCOL);

    /* a REPLY with the longest message the daemon sends fits a receive */
    char msg[4001];
    memset(msg, 'm', 4000);
    msg[4000] = 0;
    static uint8_t lbuf[KVC_FD_MAX_RECORD];
    n = kvc_fd_encode_reply(lbuf, sizeof lbuf, 7, 13, 0, msg);
    CHECK(n == 16 + 24 + 4000);
    int sv[2];
    int eof = 0;
    CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) == 0);
    CHECK(kvc_fd_send(sv[0], lbuf, n, NULL, 0, err, sizeof err) == KVC_OK);
    CHECK(kvc_fd_recv(sv[1], 1000, &rec, &eof, err, sizeof err) == KVC_OK);
    CHECK(!eof && rec.type == KVC_FD_REPLY && rec.error_code == 13 && strlen(rec.message) == 4000);
    /* and the largest FREE goes through a SOCK_SEQPACKET socket as one record */
    n = kvc_fd_encode_free(big, sizeof big, 3, many, KVC_FD_MAX_FREE_IDS);
    CHECK(kvc_fd_send(sv[1], big, n, NULL, 0, err, sizeof err) == KVC_OK);
    static uint8_t got[KVC_FD_MAX_CLIENT_RECORD + 8];
    CHECK(recv(sv[0], got, sizeof got, 0) == (ssize_t)n && memcmp(got, big, n) == 0);
    close(sv[0]);
    close(sv[1]);
}

int main(void)
{
    test_hello_vector();
    test_pages_vector();
    test_adopt_vector();
    test_error_goodbye_vectors();
    test_request_vectors();
    test_malformed();
    test_transport();
    if (failures) {
        printf("0 passed, %d failed\n", failures);
        return 1;
    }
    printf("fdchannel: all checks passed\n");
    return 0;
}
