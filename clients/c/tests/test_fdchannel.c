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

    /* an oversized record is truncated: PROTOCOL (the largest a client
     * takes is max_daemon_record, KVC_FD_MAX_RECV) */
    static uint8_t big[KVC_FD_MAX_CLIENT_RECORD + 64];
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
    /* count 0 is well formed (the daemon answers it INVALID_ARGUMENT) */
    CHECK(kvc_fd_encode_free(buf, sizeof buf, 9, NULL, 0) == 16 + 16);
    CHECK(kvc_fd_encode_free(buf, sizeof buf, 9, NULL, 1) == 0);
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
    /* the largest DROP (the spec's max_drop_ids, 519 ids: 4176 bytes, the
     * daemon's largest record) is received whole */
    CHECK(KVC_FD_MAX_DROP_IDS == 519 && KVC_FD_MAX_RECV == KVC_FD_MAX_RECORD);
    n = kvc_fd_encode_drop(big, sizeof big, many, KVC_FD_MAX_DROP_IDS);
    CHECK(n == 16 + 8 + 8 * KVC_FD_MAX_DROP_IDS && n == KVC_FD_MAX_RECV);
    CHECK(kvc_fd_send(sv[0], big, n, NULL, 0, err, sizeof err) == KVC_OK);
    CHECK(kvc_fd_recv(sv[1], 1000, &rec, &eof, err, sizeof err) == KVC_OK);
    CHECK(!eof && rec.type == KVC_FD_DROP && rec.count == KVC_FD_MAX_DROP_IDS);
    CHECK(kvc_fd_record_id(&rec, 0) == 1 && kvc_fd_record_id(&rec, KVC_FD_MAX_DROP_IDS - 1) == KVC_FD_MAX_DROP_IDS);
    CHECK(kvc_fd_encode_drop(big, sizeof big, many, KVC_FD_MAX_DROP_IDS + 1) == 0);
    /* one id more (framed by hand: the encoder refuses it) is a protocol
     * error, as the Python decoder says it; on the socket it is cut */
    big[8] = (uint8_t)((8 + 8 * 520) & 0xff); /* payload_len 4168 */
    big[9] = (uint8_t)((8 + 8 * 520) >> 8);
    big[16] = (uint8_t)(520 & 0xff); /* count */
    big[17] = (uint8_t)(520 >> 8);
    memset(big + 16 + 8 + 8 * 519, 0, 8);
    big[16 + 8 + 8 * 519] = 0x08; /* id 520 */
    CHECK(kvc_fd_decode(big, 16 + 8 + 8 * 520, NULL, 0, &rec, err, sizeof err) == KVC_ERR_PROTOCOL);
    CHECK(strcmp(err, "DROP record says 520 page ids and has 4160 bytes of them") == 0);
    CHECK(kvc_fd_send(sv[0], big, 16 + 8 + 8 * 520, NULL, 0, err, sizeof err) == KVC_OK);
    CHECK(kvc_fd_recv(sv[1], 1000, &rec, &eof, err, sizeof err) == KVC_ERR_PROTOCOL);
    CHECK(strstr(err, "truncated") != NULL);
    CHECK(kvc_fd_encode_drop(big, sizeof big, many, 0) == 0);
    close(sv[0]);
    close(sv[1]);
}

/* Kept handles: FREE with keep, DROP, DROPPED (the bytes of the shared
 * vectors free_keep, drop and dropped; kvcached_service/fdchannel.py). */
static void test_keep_vectors(void)
{
    uint8_t buf[256];
    uint64_t ids[2] = {7, 8};
    static const uint8_t fk[] = {0x4b, 0x56, 0x43, 0x46, 0x01, 0x00, 0x07, 0x00, 0x20, 0x00, 0x00, 0x00,
                                 0x00, 0x00, 0x00, 0x00, 0x09, 0, 0, 0, 0, 0, 0, 0, 0x02, 0, 0, 0,
                                 0x01, 0, 0, 0, 0x07, 0, 0, 0, 0, 0, 0, 0, 0x08, 0, 0, 0, 0, 0, 0, 0};
    size_t n = kvc_fd_encode_free_flags(buf, sizeof buf, 9, ids, 2, KVC_FD_FREE_KEEP);
    CHECK(n == sizeof fk && memcmp(buf, fk, n) == 0);
    uint64_t req = 0;
    CHECK(kvc_fd_decode_any(buf, n, NULL, 0, &rec, &req, err, sizeof err) == KVC_OK);
    CHECK(rec.type == KVC_FD_FREE && rec.flags == KVC_FD_FREE_KEEP && rec.count == 2 &&
          kvc_fd_record_id(&rec, 1) == 8);
    /* without keep: the plain FREE's bytes */
    CHECK(kvc_fd_encode_free_flags(buf, sizeof buf, 9, ids, 2, 0) == sizeof fk);
    CHECK(buf[28] == 0);
    static const uint8_t dropped[] = {0x4b, 0x56, 0x43, 0x46, 0x01, 0x00, 0x0c, 0x00, 0x20, 0x00, 0x00,
                                      0x00, 0x00, 0x00, 0x00, 0x00, 0x0b, 0, 0, 0, 0, 0, 0, 0,
                                      0x02, 0, 0, 0, 0, 0, 0, 0, 0x07, 0, 0, 0, 0, 0, 0, 0,
                                      0x08, 0, 0, 0, 0, 0, 0, 0};
    n = kvc_fd_encode_dropped(buf, sizeof buf, 11, ids, 2);
    CHECK(n == sizeof dropped && memcmp(buf, dropped, n) == 0);
    CHECK(kvc_fd_encode_dropped(buf, sizeof buf, 12, NULL, 0) == 32);
    /* a client refuses DROPPED (only clients send it) */
    CHECK(kvc_fd_decode(dropped, sizeof dropped, NULL, 0, &rec, err, sizeof err) == KVC_ERR_PROTOCOL);
    static const uint8_t drop[] = {0x4b, 0x56, 0x43, 0x46, 0x01, 0x00, 0x0b, 0x00, 0x18, 0x00, 0x00, 0x00,
                                   0x00, 0x00, 0x00, 0x00, 0x02, 0, 0, 0, 0, 0, 0, 0,
                                   0x07, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
    uint64_t dids[2] = {7, ~0ull};
    n = kvc_fd_encode_drop(buf, sizeof buf, dids, 2);
    CHECK(n == sizeof drop && memcmp(buf, drop, n) == 0);
    CHECK(kvc_fd_decode(drop, sizeof drop, NULL, 0, &rec, err, sizeof err) == KVC_OK);
    CHECK(rec.type == KVC_FD_DROP && rec.count == 2 && kvc_fd_record_id(&rec, 1) == ~0ull);
    int fake = 99;
    CHECK(kvc_fd_decode(drop, sizeof drop, &fake, 1, &rec, err, sizeof err) == KVC_ERR_PROTOCOL);
    CHECK(strstr(err, "descriptors") != NULL);
}

/* ---- the shared vectors: protos/kvcached/v1/fdchannel.vectors.json ----
 * A tiny JSON reader (objects, arrays, strings with escapes, numbers,
 * true/false/null): enough for the vectors file, no dependency. */

typedef struct jv {
    enum { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ } t;
    double num;
    int b;
    char *str;          /* J_STR (UTF-8, NUL-terminated; len below) */
    size_t len;
    struct jv **items;  /* J_ARR / J_OBJ values */
    char **keys;        /* J_OBJ */
    size_t n;
} jv;

static const char *jp;
static int jerr;

static void jws(void)
{
    while (*jp == ' ' || *jp == '\n' || *jp == '\r' || *jp == '\t')
        jp++;
}

static void jput(char **b, size_t *len, size_t *cap, unsigned c)
{
    if (*len + 5 > *cap) {
        *cap = *cap * 2 + 16;
        *b = realloc(*b, *cap);
    }
    (*b)[(*len)++] = (char)c;
}

static void jput_utf8(char **b, size_t *len, size_t *cap, unsigned cp)
{
    if (cp < 0x80) {
        jput(b, len, cap, cp);
    } else if (cp < 0x800) {
        jput(b, len, cap, 0xC0 | (cp >> 6));
        jput(b, len, cap, 0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        jput(b, len, cap, 0xE0 | (cp >> 12));
        jput(b, len, cap, 0x80 | ((cp >> 6) & 0x3F));
        jput(b, len, cap, 0x80 | (cp & 0x3F));
    } else {
        jput(b, len, cap, 0xF0 | (cp >> 18));
        jput(b, len, cap, 0x80 | ((cp >> 12) & 0x3F));
        jput(b, len, cap, 0x80 | ((cp >> 6) & 0x3F));
        jput(b, len, cap, 0x80 | (cp & 0x3F));
    }
}

static unsigned jhex4(void)
{
    unsigned v = 0;
    for (int i = 0; i < 4; i++, jp++) {
        char c = *jp;
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else jerr = 1;
    }
    return v;
}

static char *jstring(size_t *out_len)
{
    size_t len = 0, cap = 16;
    char *b = malloc(cap);
    jp++; /* opening quote */
    while (*jp && *jp != '"') {
        if (*jp != '\\') {
            jput(&b, &len, &cap, (unsigned char)*jp++);
            continue;
        }
        jp++;
        char e = *jp++;
        switch (e) {
        case '"': jput(&b, &len, &cap, '"'); break;
        case '\\': jput(&b, &len, &cap, '\\'); break;
        case '/': jput(&b, &len, &cap, '/'); break;
        case 'b': jput(&b, &len, &cap, '\b'); break;
        case 'f': jput(&b, &len, &cap, '\f'); break;
        case 'n': jput(&b, &len, &cap, '\n'); break;
        case 'r': jput(&b, &len, &cap, '\r'); break;
        case 't': jput(&b, &len, &cap, '\t'); break;
        case 'u': {
            unsigned cp = jhex4();
            if (cp >= 0xD800 && cp < 0xDC00 && jp[0] == '\\' && jp[1] == 'u') {
                jp += 2;
                unsigned lo = jhex4();
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            }
            jput_utf8(&b, &len, &cap, cp);
            break;
        }
        default: jerr = 1;
        }
    }
    if (*jp != '"')
        jerr = 1;
    else
        jp++;
    b[len] = 0;
    *out_len = len;
    return b;
}

static jv *jvalue(void);

static jv *jnew(int t)
{
    jv *v = calloc(1, sizeof *v);
    v->t = t;
    return v;
}

static jv *jvalue(void)
{
    jws();
    jv *v;
    if (*jp == '{' || *jp == '[') {
        int obj = *jp == '{';
        v = jnew(obj ? J_OBJ : J_ARR);
        jp++;
        jws();
        if (*jp == (obj ? '}' : ']')) {
            jp++;
            return v;
        }
        for (;;) {
            char *key = NULL;
            if (obj) {
                jws();
                size_t kl;
                if (*jp != '"') { jerr = 1; return v; }
                key = jstring(&kl);
                jws();
                if (*jp++ != ':') { jerr = 1; free(key); return v; }
            }
            jv *item = jvalue();
            v->items = realloc(v->items, (v->n + 1) * sizeof *v->items);
            v->keys = realloc(v->keys, (v->n + 1) * sizeof *v->keys);
            v->items[v->n] = item;
            v->keys[v->n] = key;
            v->n++;
            jws();
            if (*jp == ',') { jp++; continue; }
            if (*jp == (obj ? '}' : ']')) { jp++; return v; }
            jerr = 1;
            return v;
        }
    }
    if (*jp == '"') {
        v = jnew(J_STR);
        v->str = jstring(&v->len);
        return v;
    }
    if (!strncmp(jp, "true", 4) || !strncmp(jp, "false", 5)) {
        v = jnew(J_BOOL);
        v->b = *jp == 't';
        jp += v->b ? 4 : 5;
        return v;
    }
    if (!strncmp(jp, "null", 4)) {
        jp += 4;
        return jnew(J_NULL);
    }
    char *end;
    v = jnew(J_NUM);
    v->num = strtod(jp, &end);
    if (end == jp)
        jerr = 1;
    jp = end;
    return v;
}

static void jfree(jv *v)
{
    if (!v)
        return;
    for (size_t i = 0; i < v->n; i++) {
        jfree(v->items[i]);
        if (v->keys)
            free(v->keys[i]);
    }
    free(v->items);
    free(v->keys);
    free(v->str);
    free(v);
}

static jv *jget(const jv *o, const char *key)
{
    if (!o || o->t != J_OBJ)
        return NULL;
    for (size_t i = 0; i < o->n; i++)
        if (!strcmp(o->keys[i], key))
            return o->items[i];
    return NULL;
}

static const char *jstr(const jv *o, const char *key)
{
    const jv *v = jget(o, key);
    return v && v->t == J_STR ? v->str : "";
}

static uint64_t ju64(const jv *v) /* u64 values are decimal strings; small ones numbers */
{
    if (!v)
        return ~0ull;
    if (v->t == J_STR)
        return strtoull(v->str, NULL, 10);
    return (uint64_t)v->num;
}

static size_t unhex(const char *h, uint8_t *out, size_t cap)
{
    size_t n = strlen(h) / 2;
    if (n > cap)
        return (size_t)-1;
    for (size_t i = 0; i < n; i++) {
        unsigned x;
        sscanf(h + 2 * i, "%2x", &x);
        out[i] = (uint8_t)x;
    }
    return n;
}

/* The C client keeps message bytes as the daemon sent them; the vectors
 * give Python's reading (invalid UTF-8 replaced by U+FFFD). Compare the
 * same way: each byte that does not begin a valid sequence reads as U+FFFD. */
static void utf8_replace(const char *in, char *out, size_t cap)
{
    const unsigned char *p = (const unsigned char *)in;
    size_t o = 0;
    while (*p && o + 4 < cap) {
        int n = *p < 0x80 ? 1 : (*p >> 5) == 6 ? 2 : (*p >> 4) == 14 ? 3 : (*p >> 3) == 30 ? 4 : 0;
        int ok = n > 0;
        for (int i = 1; ok && i < n; i++)
            ok = (p[i] & 0xC0) == 0x80;
        if (ok) {
            memcpy(out + o, p, (size_t)n);
            o += (size_t)n;
            p += n;
        } else {
            memcpy(out + o, "\xEF\xBF\xBD", 3);
            o += 3;
            p++;
        }
    }
    out[o] = 0;
}

static const char *rec_type_name(uint16_t t)
{
    static const char *names[] = {"?",    "HELLO", "PAGES", "ERROR", "GOODBYE", "ADOPT",
                                  "ALLOCATE", "FREE", "CLOSE", "REPLY", "ANSWER", "DROP",
                                  "DROPPED", "USE"};
    return t <= 13 ? names[t] : "?";
}

static int vec_failures;
#define VCHECK(name, cond)                                                              \
    do {                                                                                \
        if (!(cond)) {                                                                  \
            fprintf(stderr, "vector %s: CHECK failed: %s (line %d)\n", name, #cond, __LINE__); \
            failures++;                                                                 \
            vec_failures++;                                                             \
        }                                                                               \
    } while (0)

/* Every field the vector's record names must be what the C decoder read. */
static void check_record_fields(const char *name, const jv *want, const kvc_fd_record *r)
{
    for (size_t i = 0; i < want->n; i++) {
        const char *k = want->keys[i];
        const jv *v = want->items[i];
        if (!strcmp(k, "type")) {
            VCHECK(name, !strcmp(v->str, rec_type_name(r->type)));
        } else if (!strcmp(k, "channel_id")) {
            VCHECK(name, r->channel_id == ju64(v));
        } else if (!strcmp(k, "allocation_id") || !strcmp(k, "session_id")) {
            VCHECK(name, r->allocation_id == ju64(v));
        } else if (!strcmp(k, "req_id")) {
            VCHECK(name, r->req_id == ju64(v));
        } else if (!strcmp(k, "value")) {
            VCHECK(name, r->value == ju64(v));
        } else if (!strcmp(k, "reclaim_id")) {
            VCHECK(name, r->reclaim_id == ju64(v));
        } else if (!strcmp(k, "bytes_given")) {
            VCHECK(name, r->bytes_given == ju64(v));
        } else if (!strcmp(k, "bytes_kept")) {
            VCHECK(name, r->bytes_kept == ju64(v));
        } else if (!strcmp(k, "pid")) {
            VCHECK(name, r->pid == ju64(v));
        } else if (!strcmp(k, "uid")) {
            VCHECK(name, r->uid == ju64(v));
        } else if (!strcmp(k, "gid")) {
            VCHECK(name, r->gid == ju64(v));
        } else if (!strcmp(k, "max_fds")) {
            VCHECK(name, r->max_fds == ju64(v));
        } else if (!strcmp(k, "first_index")) {
            VCHECK(name, r->first_index == ju64(v));
        } else if (!strcmp(k, "count")) {
            VCHECK(name, r->count == ju64(v));
        } else if (!strcmp(k, "total")) {
            VCHECK(name, r->total == ju64(v));
        } else if (!strcmp(k, "num_pages")) {
            VCHECK(name, r->num_pages == ju64(v));
        } else if (!strcmp(k, "flags")) {
            VCHECK(name, r->flags == ju64(v));
        } else if (!strcmp(k, "keep")) {
            VCHECK(name, r->type == KVC_FD_FREE);
            VCHECK(name, !!(r->flags & KVC_FD_FREE_KEEP) == v->b);
        } else if (!strcmp(k, "standby")) {
            VCHECK(name, r->type == KVC_FD_FREE);
            VCHECK(name, !!(r->flags & KVC_FD_FREE_STANDBY) == v->b);
        } else if (!strcmp(k, "wait")) {
            VCHECK(name, !!(r->flags & KVC_FD_ALLOC_WAIT) == v->b);
        } else if (!strcmp(k, "notify")) {
            VCHECK(name, !!(r->flags & KVC_FD_ALLOC_NOTIFY) == v->b);
        } else if (!strcmp(k, "wait_timeout_ms")) {
            VCHECK(name, r->wait_timeout_ms == ju64(v));
        } else if (!strcmp(k, "code")) {
            VCHECK(name, r->error_code == ju64(v));
        } else if (!strcmp(k, "secret")) {
            uint8_t sec[KVC_FD_SECRET_SIZE];
            VCHECK(name, unhex(v->str, sec, sizeof sec) == KVC_FD_SECRET_SIZE &&
                             !memcmp(sec, r->secret, KVC_FD_SECRET_SIZE));
        } else if (!strcmp(k, "page_ids")) {
            VCHECK(name, v->t == J_ARR);
            const int by_bytes = r->type == KVC_FD_FREE || r->type == KVC_FD_DROPPED ||
                                 r->type == KVC_FD_USE || r->type == KVC_FD_DROP;
            VCHECK(name, !by_bytes || v->n == r->count);
            for (size_t j = 0; j < v->n; j++) {
                uint64_t id = by_bytes ? kvc_fd_record_id(r, (uint32_t)j) : r->page_ids[j];
                VCHECK(name, id == ju64(v->items[j]));
            }
        } else if (!strcmp(k, "message") || !strcmp(k, "device") || !strcmp(k, "reason")) {
            const char *got = !strcmp(k, "message") ? r->message
                              : !strcmp(k, "device") ? r->device : r->reason;
            static char norm[2 * KVC_FD_MAX_MESSAGE + 8];
            utf8_replace(got, norm, sizeof norm);
            VCHECK(name, !strcmp(norm, v->str));
        } else {
            fprintf(stderr, "vector %s: field %s is not checked by this test\n", name, k);
            failures++;
            vec_failures++;
        }
    }
}

/* Re-encode a canonical record with the C encoders: the same bytes. */
static size_t reencode(const kvc_fd_record *r, uint8_t *buf, size_t cap)
{
    switch (r->type) {
    case KVC_FD_HELLO:
        return kvc_fd_encode_hello(buf, cap, r->channel_id, r->pid, r->uid, r->gid, r->max_fds,
                                   r->secret);
    case KVC_FD_PAGES:
        return kvc_fd_encode_pages(buf, cap, r->allocation_id, r->first_index, r->total,
                                   r->page_ids, r->count);
    case KVC_FD_ADOPT:
        return kvc_fd_encode_adopt(buf, cap, r->allocation_id, r->first_index, r->total,
                                   r->page_ids, r->count);
    case KVC_FD_ERROR:
        return kvc_fd_encode_error(buf, cap, r->error_code, r->message);
    case KVC_FD_GOODBYE:
        return kvc_fd_encode_goodbye(buf, cap);
    case KVC_FD_REPLY:
        return kvc_fd_encode_reply(buf, cap, r->req_id, r->error_code, r->value, r->message);
    case KVC_FD_ALLOCATE:
        return kvc_fd_encode_allocate(buf, cap, r->req_id, r->num_pages, r->flags,
                                      r->wait_timeout_ms, r->device);
    case KVC_FD_FREE:
    case KVC_FD_DROPPED:
    case KVC_FD_USE:
    case KVC_FD_DROP: {
        static uint64_t ids[KVC_FD_MAX_FREE_IDS];
        for (uint32_t j = 0; j < r->count; j++)
            ids[j] = kvc_fd_record_id(r, j);
        if (r->type == KVC_FD_DROP)
            return kvc_fd_encode_drop(buf, cap, ids, r->count);
        if (r->type == KVC_FD_USE)
            return kvc_fd_encode_use(buf, cap, r->req_id, r->count ? ids : NULL, r->count);
        if (r->type == KVC_FD_DROPPED)
            return kvc_fd_encode_dropped(buf, cap, r->req_id, r->count ? ids : NULL, r->count);
        if (r->flags == 0) /* the plain encoder, as before flags */
            return kvc_fd_encode_free(buf, cap, r->req_id, r->count ? ids : NULL, r->count);
        return kvc_fd_encode_free_flags(buf, cap, r->req_id, r->count ? ids : NULL, r->count,
                                        r->flags);
    }
    case KVC_FD_CLOSE:
        return kvc_fd_encode_close(buf, cap, r->req_id);
    case KVC_FD_ANSWER:
        return kvc_fd_encode_answer(buf, cap, r->req_id, r->reclaim_id, r->bytes_given,
                                    r->bytes_kept, r->reason);
    }
    return 0;
}

static int fake_fds[300];

static void test_shared_vectors(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "cannot open the shared vectors %s\n", path);
        failures++;
        return;
    }
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc((size_t)size + 1);
    CHECK(fread(text, 1, (size_t)size, f) == (size_t)size);
    text[size] = 0;
    fclose(f);
    jp = text;
    jerr = 0;
    jv *root = jvalue();
    CHECK(!jerr && root->t == J_OBJ);
    CHECK(ju64(jget(root, "version")) == 1);
    for (int i = 0; i < 300; i++)
        fake_fds[i] = 1000 + i;
    static uint8_t bytes[KVC_FD_MAX_CLIENT_RECORD + 64], again[KVC_FD_MAX_CLIENT_RECORD + 64];
    static kvc_fd_record r, rc;
    static char e[512];
    int positive = 0, protocol = 0, malformed = 0, unexpected = 0;
    const jv *vecs = jget(root, "vectors");
    CHECK(vecs && vecs->t == J_ARR && vecs->n > 0);
    for (size_t i = 0; vecs && i < vecs->n; i++) {
        const jv *vec = vecs->items[i];
        const char *name = jstr(vec, "name");
        size_t n = unhex(jstr(vec, "hex"), bytes, sizeof bytes);
        size_t nfds = (size_t)ju64(jget(vec, "fds"));
        VCHECK(name, n != (size_t)-1 && nfds <= 300);
        const char *sent_by = jstr(vec, "sent_by");
        const jv *want = jget(vec, "record");
        uint64_t req = 0;
        memset(&r, 0, sizeof r);
        kvc_status st = kvc_fd_decode_any(bytes, n, fake_fds, nfds, &r, &req, e, sizeof e);
        /* what a client does with it: only daemon records decode */
        kvc_status cst = kvc_fd_decode(bytes, n, fake_fds, nfds, &rc, e + 256, 256);
        if (want) {
            positive++;
            VCHECK(name, st == KVC_OK);
            if (st != KVC_OK) {
                fprintf(stderr, "vector %s: %s\n", name, e);
                continue;
            }
            check_record_fields(name, want, &r);
            if (!strcmp(sent_by, "daemon"))
                VCHECK(name, cst == KVC_OK && rc.type == r.type);
            else
                VCHECK(name, cst == KVC_ERR_PROTOCOL && rc.num_fds == 0);
            const jv *canon = jget(vec, "canonical");
            if (canon && canon->b) {
                size_t m = reencode(&r, again, sizeof again);
                VCHECK(name, m == n && !memcmp(again, bytes, n));
            }
            continue;
        }
        const char *error = jstr(vec, "error");
        VCHECK(name, !strcmp(jstr(vec, "client"), "close"));
        VCHECK(name, cst == KVC_ERR_PROTOCOL); /* a client closes the channel on every one */
        if (!strcmp(error, "protocol")) {
            protocol++;
            VCHECK(name, st == KVC_ERR_PROTOCOL);
            VCHECK(name, !strcmp(jstr(vec, "daemon"), "close"));
        } else {
            malformed++;
            VCHECK(name, !strcmp(error, "malformed_request"));
            VCHECK(name, st == KVC_ERR_INVALID_ARGUMENT);
            VCHECK(name, req == ju64(jget(vec, "req_id")));
            const jv *reply = jget(vec, "reply");
            VCHECK(name, ju64(jget(reply, "code")) == 3); /* INVALID_ARGUMENT */
            VCHECK(name, !strcmp(e, jstr(reply, "message")));
            if (strcmp(e, jstr(reply, "message")))
                fprintf(stderr, "  C: \"%s\"\n  daemon: \"%s\"\n", e, jstr(reply, "message"));
            VCHECK(name, !strcmp(jstr(vec, "daemon"), "reply"));
        }
    }
    /* Well-formed records at the wrong end: a daemon drops them (they
     * decode), a client's decoder refuses requests; a second HELLO decodes
     * and the client's channel treats it as a protocol error (channel.cc). */
    const jv *unexp = jget(root, "unexpected");
    CHECK(unexp && unexp->t == J_ARR && unexp->n > 0);
    for (size_t i = 0; unexp && i < unexp->n; i++) {
        const jv *u = unexp->items[i];
        const char *name = jstr(u, "name");
        size_t n = unhex(jstr(u, "hex"), bytes, sizeof bytes);
        size_t nfds = (size_t)ju64(jget(u, "fds"));
        unexpected++;
        VCHECK(name, kvc_fd_decode_any(bytes, n, fake_fds, nfds, &r, NULL, e, sizeof e) == KVC_OK);
        kvc_status cst = kvc_fd_decode(bytes, n, fake_fds, nfds, &rc, e, sizeof e);
        if (!strcmp(jstr(u, "receiver"), "daemon")) {
            VCHECK(name, !strcmp(jstr(u, "outcome"), "drop"));
        } else {
            VCHECK(name, !strcmp(jstr(u, "outcome"), "protocol_error"));
            VCHECK(name, cst == KVC_ERR_PROTOCOL || (cst == KVC_OK && rc.type == KVC_FD_HELLO));
        }
    }
    printf("shared vectors: %d positive, %d protocol errors, %d malformed requests, %d unexpected; "
           "%d failed checks\n",
           positive, protocol, malformed, unexpected, vec_failures);
    CHECK(positive > 0 && protocol > 0 && malformed > 0 && unexpected > 0);
    jfree(root);
    free(text);
}

int main(int argc, char **argv)
{
    test_hello_vector();
    test_pages_vector();
    test_adopt_vector();
    test_error_goodbye_vectors();
    test_request_vectors();
    test_keep_vectors();
    test_malformed();
    test_transport();
    test_shared_vectors(argc > 1 ? argv[1] : "protos/kvcached/v1/fdchannel.vectors.json");
    if (failures) {
        printf("0 passed, %d failed\n", failures);
        return 1;
    }
    printf("fdchannel: all checks passed\n");
    return 0;
}
