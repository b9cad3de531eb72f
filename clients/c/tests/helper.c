/* kvc_test_helper: small client processes the integration tests start (so
 * each has its own environment, CUDA driver and lifetime).
 *   helper open SOCK            open a session; prints "STATUS <name> <message>"
 *   helper map SOCK PAGES       open, map PAGES pages of a region; prints the
 *                               status of the map and the bytes still held
 *                               after the region is destroyed
 *   helper hold SOCK PAGES      open, map PAGES pages, print "READY", sleep
 *   helper unmapruns SOCK       open, map 4 pages of a region (page 2 a local
 *                               page), unmap pages 0-2 (one run); prints
 *                               the unmap's status, what is mapped and held
 *                               then and after the region is destroyed, and
 *                               the pid (for the driver's call counters)
 *   helper shrink SOCK ID       open, RequestShrink(session ID, 0); prints the status
 *   helper cycle SOCK N         N x (connect, open, alloc, free, close,
 *                               disconnect); exit 0 if all succeeded; prints
 *                               whether the sessions were resumable and how
 *                               many fds cycles 2..N left open (each count
 *                               taken once the count has settled) */
#include <dirent.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvcached.h"

static kvc_session *open_session(const char *sock, kvc_client **client, kvc_status *st)
{
    kvc_session *s = NULL;
    *st = kvc_client_create(sock, client);
    if (*st != KVC_OK)
        return NULL;
    kvc_session_options o;
    kvc_session_options_init(&o);
    o.name = "helper";
    *st = kvc_session_open(*client, &o, &s);
    return s;
}

static int count_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    int n = 0;
    if (!d)
        return -1;
    while (readdir(d))
        n++;
    closedir(d);
    return n;
}

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* The number of open fds once it has stopped changing. gRPC closes a
 * destroyed channel's socket, and the epoll fd and eventfd of its poller, on
 * its own threads after kvc_client_destroy has returned (late under valgrind
 * or a loaded machine), so one count taken right after a cycle can include
 * up to 3 fds that are about to close: FDS_LEAKED -3 when the baseline caught
 * them, or a false leak when the final count did. Settled: the same count for
 * 500 ms, sampled every 10 ms; after 20 s the last count is taken as it is. */
static int settled_fds(void)
{
    const long long settle_ms = 500, deadline = now_ms() + 20000;
    int last = count_fds();
    long long since = now_ms();
    while (now_ms() - since < settle_ms && now_ms() < deadline) {
        usleep(10 * 1000);
        int n = count_fds();
        if (n != last) {
            last = n;
            since = now_ms();
        }
    }
    return last;
}

static void print_status(kvc_status st)
{
    printf("STATUS %s %s\n", kvc_status_to_string(st), st == KVC_OK ? "" : kvc_last_error());
    fflush(stdout);
}

int main(int argc, char **argv)
{
    if (argc < 3)
        return 2;
    const char *cmd = argv[1], *sock = argv[2];
    uint64_t n = argc > 3 ? strtoull(argv[3], NULL, 0) : 1;
    kvc_client *client = NULL;
    kvc_status st;
    if (strcmp(cmd, "cycle") == 0) {
        int resumable = 0;
        int fds_before = -1; /* after the first cycle: gRPC's process-wide fds stay */
        for (uint64_t i = 0; i < n; i++) {
            kvc_session *s = open_session(sock, &client, &st);
            if (s)
                resumable = kvc_session_is_resumable(s);
            void *p = NULL;
            if (st == KVC_OK)
                st = kvc_session_alloc(s, 3u << 20, &p);
            if (st == KVC_OK)
                st = kvc_session_free(s, p);
            kvc_region *r = NULL;
            if (st == KVC_OK)
                st = kvc_region_create(s, 16u << 20, &r);
            if (st == KVC_OK)
                st = kvc_region_map(r, 0, 5u << 20);
            kvc_region_destroy(r);
            if (s) {
                kvc_status c = kvc_session_close(s);
                if (st == KVC_OK)
                    st = c;
            }
            kvc_client_destroy(client);
            if (st != KVC_OK) {
                print_status(st);
                return 1;
            }
            if (i == 0)
                fds_before = settled_fds();
        }
        print_status(KVC_OK);
        /* Every page fd (and a resumable session's kept duplicates) closed. */
        printf("RESUMABLE %d FDS_LEAKED %d\n", resumable, settled_fds() - fds_before);
        return 0;
    }
    kvc_session *s = open_session(sock, &client, &st);
    if (strcmp(cmd, "open") == 0 || st != KVC_OK) {
        print_status(st);
        kvc_session_close(s);
        kvc_client_destroy(client);
        return 0;
    }
    if (strcmp(cmd, "shrink") == 0) {
        print_status(kvc_session_request_shrink(s, n, 0, 1000, NULL));
        kvc_session_close(s);
        kvc_client_destroy(client);
        return 0;
    }
    if (strcmp(cmd, "unmapruns") == 0) {
        kvc_region *r = NULL;
        uint64_t page = kvc_session_page_size(s);
        kvc_range daemon_pages[2] = {{0, 2 * page}, {3 * page, page}}, local = {2 * page, page};
        st = kvc_region_create(s, 4 * page, &r);
        if (st == KVC_OK)
            st = kvc_region_map_ranges(r, daemon_pages, 2);
        if (st == KVC_OK)
            st = kvc_region_map_ranges_local(r, &local, 1);
        if (st == KVC_OK)
            st = kvc_region_unmap(r, 0, 3 * page);
        print_status(st);
        printf("PID %d\nMAPPED %" PRIu64 " LOCAL %" PRIu64 " HELD %" PRIu64 " PAGES\n", (int)getpid(),
               kvc_region_mapped_bytes(r) / page, kvc_region_local_bytes(r) / page,
               kvc_session_held_bytes(s) / page);
        kvc_region_destroy(r);
        printf("DESTROYED HELD %" PRIu64 "\n", kvc_session_held_bytes(s));
        kvc_session_close(s);
        kvc_client_destroy(client);
        return 0;
    }
    kvc_region *r = NULL;
    uint64_t page = kvc_session_page_size(s);
    st = kvc_region_create(s, n * page, &r);
    if (st == KVC_OK)
        st = kvc_region_map(r, 0, n * page);
    if (strcmp(cmd, "hold") == 0) {
        if (st == KVC_OK) {
            printf("READY\n");
            fflush(stdout);
            for (;;)
                pause();
        }
        print_status(st);
        return 1;
    }
    print_status(st);
    kvc_region_destroy(r);
    printf("HELD %" PRIu64 "\n", kvc_session_held_bytes(s));
    kvc_session_close(s);
    kvc_client_destroy(client);
    return 0;
}
