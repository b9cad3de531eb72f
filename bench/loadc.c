/* A compiled load client of the fd channel (docs/benchmarks.md, scenario 2,
 * "C client" rows): N client processes, each a session doing one-page
 * Allocate+Free pairs as request records on its own fd channel, with no
 * Python on the client side, so the figures show what the daemon costs.
 *
 * It speaks the records of docs/protocol.md ("Requests on the channel") and
 * protos/kvcached/v1/fdchannel.spec.json directly:
 *
 *   client: ALLOCATE(req_id, num_pages 1, flags 0, wait 0, device "")
 *   daemon: PAGES(req_id | 1<<63, first 0, count 1, total 1, page id) + 1 fd
 *   daemon: REPLY(req_id, code 0, value = bytes held)
 *   client: mmap the fd (host pages; "nomap": close it only), munmap
 *   client: FREE(req_id, count 1, page id)
 *   daemon: REPLY(req_id, code 0, value 1)
 *
 * A session needs OpenSession over gRPC with the channel's HELLO secret; a
 * self-contained C program has no gRPC, so the harness does that part:
 *
 *   loadc FD_SOCKET CLIENTS rtt|tput ROUND_TRIPS|SECONDS PAGE_SIZE map|nomap
 *
 *   1. every child connects FD_SOCKET and reads HELLO; the parent prints one
 *      line per child: {"secret":"<64 hex digits>"}
 *   2. the harness calls OpenSession(channel_secret) for each (same uid:
 *      the daemon binds the session to the child, whose pid and uid the
 *      kernel named) and writes one line "go" to stdin
 *   3. every child starts its loop at once; the parent prints
 *        rtt:  {"clients":N,"n":..,"p50_us":..,"p99_us":..,"mean_us":..,"pairs":..}
 *        tput: {"clients":N,"pairs":..,"secs":..,"per_s":..}
 *      (a pair is one Allocate+Free), after every child reported; children
 *      then close their channels (the sessions end).
 *
 * Any unexpected record or non-OK REPLY: the child prints it to stderr and
 * exits 1; the parent then exits 1.
 *
 * Built by the bench harness (bench/suite.py) with cc -O2 into build/bench/.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "benchc.h"

#define MAGIC 0x4643564Bu
#define T_HELLO 1
#define T_PAGES 2
#define T_ERROR 3
#define T_ALLOCATE 6
#define T_FREE 7
#define T_REPLY 9
#define CHANNEL_ALLOC_BIT (1ull << 63)
#define MAX_REC 8192

static void put16(unsigned char *p, uint16_t v) { memcpy(p, &v, 2); } /* x86-64 and aarch64: little-endian */
static void put32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }
static uint16_t get16(const unsigned char *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static uint32_t get32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t get64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static void header(unsigned char *b, uint16_t type, uint32_t len) {
    put32(b, MAGIC);
    put16(b + 4, 1);
    put16(b + 6, type);
    put32(b + 8, len);
    put32(b + 12, 0);
}

/* One record in; its type, payload in *pl (length *len), at most one fd in *fd (-1 if none). */
static int recv_rec(int s, unsigned char *buf, const unsigned char **pl, uint32_t *len, int *fd) {
    struct iovec iov = {buf, MAX_REC};
    union {
        char b[CMSG_SPACE(sizeof(int) * 4)];
        struct cmsghdr align;
    } u;
    struct msghdr m = {0};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = u.b;
    m.msg_controllen = sizeof u.b;
    ssize_t n = recvmsg(s, &m, MSG_CMSG_CLOEXEC);
    if (n < 0) die("recvmsg");
    if (n == 0) {
        fprintf(stderr, "loadc: the daemon closed the channel\n");
        exit(1);
    }
    *fd = -1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (size_t i = 0; i < k; i++) {
                int x;
                memcpy(&x, CMSG_DATA(c) + i * sizeof(int), sizeof x);
                if (*fd < 0) *fd = x;
                else close(x);
            }
        }
    }
    if (n < 16 || get32(buf) != MAGIC || get16(buf + 4) != 1 || get32(buf + 8) != (uint32_t)n - 16 || (m.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
        fprintf(stderr, "loadc: malformed record (%zd bytes)\n", n);
        exit(1);
    }
    *pl = buf + 16;
    *len = (uint32_t)n - 16;
    return get16(buf + 6);
}

static void expect_reply(int s, unsigned char *buf, uint64_t req, uint64_t *value) {
    const unsigned char *p;
    uint32_t len;
    int fd;
    int t = recv_rec(s, buf, &p, &len, &fd);
    if (t == T_REPLY && len >= 24 && get64(p) == req && fd < 0) {
        uint32_t code = get32(p + 8);
        if (code != 0) {
            fprintf(stderr, "loadc: request %llu answered code %u: %.*s\n", (unsigned long long)req, code, (int)(len - 24), (const char *)p + 24);
            exit(1);
        }
        *value = get64(p + 16);
        return;
    }
    if (t == T_ERROR && len >= 4) fprintf(stderr, "loadc: ERROR %u: %.*s\n", get32(p), (int)(len - 4), (const char *)p + 4);
    else fprintf(stderr, "loadc: expected REPLY to %llu, got record type %d (%u bytes)\n", (unsigned long long)req, t, len);
    exit(1);
}

/* One Allocate+Free pair of one page. */
static void pair(int s, unsigned char *buf, uint64_t *req, long page_size, int map) {
    unsigned char out[40];
    uint64_t id = ++*req;
    header(out, T_ALLOCATE, 24);
    put64(out + 16, id);
    put32(out + 24, 1); /* num_pages */
    put32(out + 28, 0); /* flags */
    put32(out + 32, 0); /* wait_timeout_ms */
    put32(out + 36, 0); /* device_len: the first device */
    if (send(s, out, 40, MSG_NOSIGNAL) != 40) die("send ALLOCATE");
    const unsigned char *p;
    uint32_t len;
    int fd;
    int t = recv_rec(s, buf, &p, &len, &fd);
    if (t != T_PAGES || len != 32 || fd < 0 || get64(p) != (id | CHANNEL_ALLOC_BIT) || get32(p + 8) != 0 || get32(p + 12) != 1 ||
        get32(p + 16) != 1) {
        if (t == T_REPLY && len >= 24)
            fprintf(stderr, "loadc: ALLOCATE %llu answered code %u: %.*s\n", (unsigned long long)id, get32(p + 8), (int)(len - 24), (const char *)p + 24);
        else
            fprintf(stderr, "loadc: expected PAGES of one page for %llu, got type %d (%u bytes, fd %d)\n", (unsigned long long)id, t, len, fd);
        exit(1);
    }
    uint64_t page_id = get64(p + 24);
    uint64_t held;
    expect_reply(s, buf, id, &held);
    if (map) {
        void *a = mmap(NULL, (size_t)page_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (a == MAP_FAILED) die("mmap of a page");
        close(fd);
        munmap(a, (size_t)page_size);
    } else {
        close(fd);
    }
    id = ++*req;
    header(out, T_FREE, 24);
    put64(out + 16, id);
    put32(out + 24, 1); /* count */
    put32(out + 28, 0);
    put64(out + 32, page_id);
    if (send(s, out, 40, MSG_NOSIGNAL) != 40) die("send FREE");
    uint64_t freed;
    expect_reply(s, buf, id, &freed);
    if (freed != 1) {
        fprintf(stderr, "loadc: FREE of page %llu freed %llu pages\n", (unsigned long long)page_id, (unsigned long long)freed);
        exit(1);
    }
}

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: loadc FD_SOCKET CLIENTS rtt|tput ROUND_TRIPS|SECONDS PAGE_SIZE map|nomap\n");
        return 2;
    }
    const char *path = argv[1];
    int n = atoi(argv[2]);
    int tput = strcmp(argv[3], "tput") == 0;
    double arg = atof(argv[4]);
    long page_size = atol(argv[5]);
    int map = strcmp(argv[6], "map") == 0;
    if (n < 1 || n > 1024 || arg <= 0 || page_size <= 0 || (!tput && strcmp(argv[3], "rtt") != 0) ||
        (!map && strcmp(argv[6], "nomap") != 0) || strlen(path) >= sizeof(((struct sockaddr_un *)0)->sun_path)) {
        fprintf(stderr, "loadc: bad arguments\n");
        return 2;
    }
    int (*res)[2] = calloc((size_t)n, sizeof *res);   /* result pipe per child */
    int (*hello)[2] = calloc((size_t)n, sizeof *hello); /* secret pipe per child */
    pid_t *kids = calloc((size_t)n, sizeof *kids);
    if (!res || !hello || !kids) die("calloc");
    int go[2];
    if (pipe(go) != 0) die("pipe");
    for (int i = 0; i < n; i++) {
        if (pipe(res[i]) != 0 || pipe(hello[i]) != 0) die("pipe");
        pid_t p = fork();
        if (p < 0) die("fork");
        if (p == 0) {
            close(go[1]);
            close(res[i][0]);
            close(hello[i][0]);
            int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
            if (s < 0) die("socket");
            struct sockaddr_un sa = {.sun_family = AF_UNIX};
            strcpy(sa.sun_path, path);
            if (connect(s, (struct sockaddr *)&sa, sizeof sa) != 0) die("connect to the fd socket");
            unsigned char *buf = malloc(MAX_REC);
            if (!buf) die("malloc");
            const unsigned char *pl;
            uint32_t len;
            int fd;
            int t = recv_rec(s, buf, &pl, &len, &fd);
            if (t != T_HELLO || len != 56) {
                if (t == T_ERROR && len >= 4) fprintf(stderr, "loadc: refused: %.*s\n", (int)(len - 4), (const char *)pl + 4);
                else fprintf(stderr, "loadc: expected HELLO, got type %d\n", t);
                exit(1);
            }
            if (write(hello[i][1], pl + 24, 32) != 32) die("write secret");
            close(hello[i][1]);
            char c;
            if (read(go[0], &c, 1) < 0) die("read");
            long iters = tput ? 0 : (long)arg;
            double *lat = tput ? NULL : malloc(sizeof(double) * (size_t)iters);
            long done = 0;
            uint64_t req = 0;
            double t_end = now() + arg;
            for (;;) {
                if (tput ? now() >= t_end : done >= iters) break;
                double t0 = now();
                pair(s, buf, &req, page_size, map);
                if (lat) lat[done] = now() - t0;
                done++;
            }
            report(res[i][1], done, lat);
            close(s);
            _exit(0);
        }
        close(res[i][1]);
        close(hello[i][1]);
        kids[i] = p;
    }
    close(go[0]);
    for (int i = 0; i < n; i++) {
        unsigned char secret[32];
        size_t got = 0;
        while (got < sizeof secret) {
            ssize_t r = read(hello[i][0], secret + got, sizeof secret - got);
            if (r <= 0) {
                fprintf(stderr, "loadc: client %d got no HELLO\n", i);
                return 1;
            }
            got += (size_t)r;
        }
        close(hello[i][0]);
        printf("{\"secret\":\"");
        for (int k = 0; k < 32; k++) printf("%02x", secret[k]);
        printf("\"}\n");
    }
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin) || strncmp(line, "go", 2) != 0) {
        fprintf(stderr, "loadc: no \"go\" on stdin\n");
        return 1;
    }
    close(go[1]); /* EOF on the pipe: every client starts */
    struct results r = {0};
    int failed = 0;
    for (int i = 0; i < n; i++)
        if (read_report(res[i][0], !tput, &r) != 0) failed = 1;
    for (int i = 0; i < n; i++) {
        int st;
        waitpid(kids[i], &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) failed = 1;
    }
    if (failed) {
        fprintf(stderr, "loadc: a client failed\n");
        return 1;
    }
    if (tput) {
        printf("{\"clients\":%d,\"pairs\":%ld,\"secs\":%.6f,\"per_s\":%.1f}\n", n, r.total, arg, (double)r.total / arg);
    } else {
        double p50, p99, mean;
        summarize(&r, &p50, &p99, &mean);
        printf("{\"clients\":%d,\"n\":%zu,\"pairs\":%zu,\"p50_us\":%.2f,\"p99_us\":%.2f,\"mean_us\":%.2f}\n", n, r.n, r.n,
               p50, p99, mean);
    }
    fflush(stdout);
    return 0;
}
