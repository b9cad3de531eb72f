/* What bench/floor.c and bench/loadc.c share: the clock, fatal errors, and
 * collecting what N forked clients report (a count, then in rtt mode that
 * many latencies in seconds) into one sorted summary.
 *
 * Header-only (static functions): each program is one translation unit,
 * built by bench/suite.py's c_binary(), whose digest covers this file. */
#ifndef KVC_BENCHC_H
#define KVC_BENCHC_H

#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void die(const char *what) {
    perror(what);
    exit(2);
}

/* One client's report: `done`, then (with lat) its `done` latencies. */
static void report(int fd, long done, const double *lat) {
    if (write(fd, &done, sizeof done) != sizeof done) die("write");
    if (lat && write(fd, lat, sizeof(double) * (size_t)done) < 0) die("write");
}

/* Every latency the clients reported (rtt mode), and the sum of their counts. */
struct results {
    long total;
    double *all;
    size_t n;
};

/* Read the report of the client at `fd` into r: 0, or -1 when it sent no
 * count (it failed before reporting). A short latency array is fatal. */
static int read_report(int fd, int with_latencies, struct results *r) {
    long done = 0;
    if (read(fd, &done, sizeof done) != sizeof done) return -1;
    r->total += done;
    if (with_latencies && done > 0) {
        r->all = realloc(r->all, sizeof(double) * (r->n + (size_t)done));
        if (!r->all) die("realloc");
        size_t want = sizeof(double) * (size_t)done, got = 0;
        while (got < want) {
            ssize_t k = read(fd, (char *)(r->all + r->n) + got, want - got);
            if (k <= 0) die("read latencies");
            got += (size_t)k;
        }
        r->n += (size_t)done;
    }
    return 0;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* p50, p99 (nearest rank) and mean of r's latencies, in microseconds. */
static void summarize(struct results *r, double *p50_us, double *p99_us, double *mean_us) {
    qsort(r->all, r->n, sizeof *r->all, cmp_double);
    double sum = 0;
    for (size_t i = 0; i < r->n; i++) sum += r->all[i];
    size_t i50 = (size_t)(0.50 * (double)(r->n - 1) + 0.5), i99 = (size_t)(0.99 * (double)(r->n - 1) + 0.5);
    *p50_us = r->all[i50] * 1e6;
    *p99_us = r->all[i99] * 1e6;
    *mean_us = sum / (double)r->n * 1e6;
}

#endif
