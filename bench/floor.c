/* The transport floor of the fd channel (docs/benchmarks.md, "The floor").
 *
 * One server process and N client processes, each client connected to the
 * server by its own AF_UNIX SOCK_SEQPACKET socket (a socketpair, as
 * connect/accept would give). A round trip is one record each way, each
 * carrying one descriptor with SCM_RIGHTS, as a one-page ALLOCATE answered
 * by PAGES does:
 *
 *   client: sendmsg(40-byte request, fd of a memfd)  -> server
 *   server: recvmsg, close the fd it got, sendmsg(40-byte answer, its own
 *           memfd) back                              -> client
 *   client: recvmsg, close the fd it got
 *
 * The server is a single thread on epoll (level-triggered, one record per
 * readiness), like the daemon's event loop; the clients are plain blocking
 * loops. No Python anywhere: this is what the kernel and two context
 * switches cost, the least any daemon could do per request on this machine.
 *
 *   floor CLIENTS MODE ARG
 *     MODE rtt  ARG = round trips per client: prints
 *        {"clients":N,"n":..,"p50_us":..,"p99_us":..,"mean_us":..}
 *     MODE tput ARG = seconds: prints {"clients":N,"round_trips":..,"secs":..,"per_s":..}
 *
 * Built by the bench harness (bench/suite.py) with cc -O2 into build/bench/.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "benchc.h"

#define REC 40

static int send_fd(int sock, int fd) {
    char buf[REC] = {'K', 'V', 'C', 'F'};
    struct iovec iov = {buf, sizeof buf};
    union {
        char b[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } u;
    memset(&u, 0, sizeof u);
    struct msghdr m = {0};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = u.b;
    m.msg_controllen = sizeof u.b;
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
    return sendmsg(sock, &m, MSG_NOSIGNAL) == REC ? 0 : -1;
}

/* 1: got a record (its fd closed), 0: end of stream, -1: error */
static int recv_fd(int sock) {
    char buf[REC + 1];
    struct iovec iov = {buf, sizeof buf};
    union {
        char b[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } u;
    struct msghdr m = {0};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = u.b;
    m.msg_controllen = sizeof u.b;
    ssize_t n = recvmsg(sock, &m, MSG_CMSG_CLOEXEC);
    if (n == 0) return 0;
    if (n != REC) return -1;
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    if (!c || c->cmsg_type != SCM_RIGHTS) return -1;
    int fd;
    memcpy(&fd, CMSG_DATA(c), sizeof fd);
    close(fd);
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: floor CLIENTS rtt|tput ROUND_TRIPS|SECONDS\n");
        return 2;
    }
    int n = atoi(argv[1]);
    int tput = strcmp(argv[2], "tput") == 0;
    double arg = atof(argv[3]);
    if (n < 1 || n > 1024 || arg <= 0) {
        fprintf(stderr, "floor: bad arguments\n");
        return 2;
    }
    int page = memfd_create("floor-page", MFD_CLOEXEC);
    if (page < 0 || ftruncate(page, 4096) != 0) die("memfd_create");
    int *srv = calloc((size_t)n, sizeof *srv);
    int (*res)[2] = calloc((size_t)n, sizeof *res); /* result pipe per client */
    pid_t *kids = calloc((size_t)n, sizeof *kids);
    if (!srv || !res || !kids) die("calloc");
    /* every client starts its loop at the same moment (after all forked) */
    int go[2];
    if (pipe(go) != 0) die("pipe");
    for (int i = 0; i < n; i++) {
        int sv[2];
        if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) die("socketpair");
        if (pipe(res[i]) != 0) die("pipe");
        pid_t p = fork();
        if (p < 0) die("fork");
        if (p == 0) {
            close(sv[0]);
            close(go[1]);
            char c;
            if (read(go[0], &c, 1) < 0) die("read");
            long iters = tput ? 0 : (long)arg;
            double *lat = tput ? NULL : malloc(sizeof(double) * (size_t)iters);
            long done = 0;
            double t_end = now() + arg;
            for (;;) {
                if (tput ? now() >= t_end : done >= iters) break;
                double t0 = now();
                if (send_fd(sv[1], page) != 0 || recv_fd(sv[1]) != 1) die("client round trip");
                if (lat) lat[done] = now() - t0;
                done++;
            }
            /* hang up first (the server stops on EOF), then report: count, then the latencies */
            close(sv[1]);
            report(res[i][1], done, lat);
            _exit(0);
        }
        close(sv[1]);
        close(res[i][1]);
        srv[i] = sv[0];
        kids[i] = p;
    }
    close(go[0]);
    int ep = epoll_create1(EPOLL_CLOEXEC);
    if (ep < 0) die("epoll_create1");
    for (int i = 0; i < n; i++) {
        struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)i};
        if (epoll_ctl(ep, EPOLL_CTL_ADD, srv[i], &ev) != 0) die("epoll_ctl");
    }
    double t0 = now();
    close(go[1]); /* EOF on the pipe: every client starts */
    int open_socks = n;
    long served = 0;
    struct epoll_event evs[64];
    while (open_socks > 0) {
        int k = epoll_wait(ep, evs, 64, -1);
        if (k < 0) {
            if (errno == EINTR) continue;
            die("epoll_wait");
        }
        for (int j = 0; j < k; j++) {
            int s = srv[evs[j].data.u32];
            int r = recv_fd(s);
            if (r == 1) {
                if (send_fd(s, page) != 0) die("server send");
                served++;
            } else {
                epoll_ctl(ep, EPOLL_CTL_DEL, s, NULL);
                close(s);
                open_socks--;
            }
        }
    }
    double secs = now() - t0;
    struct results r = {0};
    for (int i = 0; i < n; i++) {
        if (read_report(res[i][0], !tput, &r) != 0) die("read result");
        waitpid(kids[i], NULL, 0);
    }
    if (tput) {
        printf("{\"clients\":%d,\"round_trips\":%ld,\"secs\":%.6f,\"per_s\":%.1f}\n", n, r.total, arg, (double)r.total / arg);
    } else {
        double p50, p99, mean;
        summarize(&r, &p50, &p99, &mean);
        printf("{\"clients\":%d,\"n\":%zu,\"p50_us\":%.2f,\"p99_us\":%.2f,\"mean_us\":%.2f,\"server_secs\":%.6f}\n", n, r.n,
               p50, p99, mean, secs);
    }
    (void)served;
    return 0;
}
