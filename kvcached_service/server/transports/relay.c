/* The control socket's byte relay, in C: no byte of gRPC passes through
 * Python.
 *
 * control.py accepts a client's connection, reads its credentials
 * (SO_PEERCRED), admits it, connects a socket of its own to grpcio's private
 * socket, and hands both connected sockets to this relay, which owns them
 * from then on: one thread, one epoll set, bytes copied both ways until
 * either side closes, then both are closed and control.py is told (an
 * eventfd it watches, then kvc_relay_reap()).
 *
 * Flow control: bytes read from one side that the other cannot take yet are
 * kept (one buffer per direction, allocated only then), and that side is
 * not read again until they are written: a side that does not read holds at
 * most one read's worth (64 KiB) of the other's bytes here, the rest waits
 * in the kernel's socket buffers.
 *
 * Closing: when a side closes (EOF) or fails, what it sent that is still
 * kept is written to the other side first (for up to _FLUSH_NS), then both
 * are closed. Until a connection is handed over, no byte of it has been read
 * by anybody, so nothing can be reordered.
 *
 * Loaded with ctypes (no Python API is used: the thread never takes the
 * GIL). Linux only (epoll, eventfd, MSG_NOSIGNAL).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* The wheel is manylinux_2_17 (auditwheel repair; the packaging suite):
 * glibc 2.34 moved pthread_create and pthread_join into libc at version
 * GLIBC_2.34, and 2.32 pthread_sigmask at GLIBC_2.32, so a build on a newer
 * glibc would ask for those and refuse to load on an older one. The same
 * functions under their original versions (in libpthread.so.0 before 2.34,
 * kept in libc since: setup.py links libpthread.so.0 in) serve every glibc;
 * what is left, clock_gettime@GLIBC_2.17 and memcpy@GLIBC_2.14, sets the
 * floor at 2.17. */
#if defined(__GLIBC__) && defined(__x86_64__)
#define KVC_GLIBC_BASE "GLIBC_2.2.5"
#elif defined(__GLIBC__) && defined(__aarch64__)
#define KVC_GLIBC_BASE "GLIBC_2.17"
#endif
#ifdef KVC_GLIBC_BASE
__asm__(".symver pthread_create,pthread_create@" KVC_GLIBC_BASE);
__asm__(".symver pthread_join,pthread_join@" KVC_GLIBC_BASE);
__asm__(".symver pthread_sigmask,pthread_sigmask@" KVC_GLIBC_BASE);
#endif

#define READ_SIZE (64 * 1024)
#define FLUSH_NS (5LL * 1000 * 1000 * 1000) /* a closing connection's kept bytes get this long */

/* why a connection ended, as kvc_relay_reap reports it */
enum { END_CLIENT = 0, END_SERVER = 1, END_ERROR = 2, END_STOP = 3 };

struct dir {           /* bytes read from side `from`, not yet written to the other side */
    char *buf;
    size_t len, off;
};

struct conn;
struct end {
    struct conn *c;
    int side;          /* 0: the client, 1: grpcio */
};

#define UNWATCHED 0xffffffffu   /* events[s]: fd[s] is not in the epoll set */

struct conn {
    uint64_t id;
    int fd[2];
    struct end end[2];
    struct dir d[2];   /* d[s]: from side s to side 1-s */
    uint32_t events[2];/* what epoll watches on fd[s] now */
    int closing;       /* a side ended: flushing what is kept, then closed */
    int timed;         /* closing, or a side hung up while its bytes wait: closed at deadline */
    int dead;          /* closed; freed after this batch of events (one may still name it) */
    int why;
    long long deadline;
    struct conn *prev, *next;
};

struct done {
    uint64_t id;
    int why;
};

struct relay {
    int ep;
    int wake;          /* eventfd: connections handed over, or stop */
    int notify;        /* the caller's eventfd: connections ended (kvc_relay_reap) */
    pthread_t thread;
    pthread_mutex_t mu;
    /* guarded by mu */
    struct conn *incoming;   /* handed over, not yet in the epoll set (linked by next) */
    int stopping;
    struct done *ended;
    size_t n_ended, cap_ended;
    /* the thread's own (n_live also read by kvc_relay_count) */
    struct conn *live;
    struct conn *dead;       /* finished during this batch of events (linked by next) */
    size_t n_live, n_timed;
    char scratch[READ_SIZE];
};

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void watch(struct relay *r, struct conn *c, int s, uint32_t events) {
    if (c->events[s] == events)
        return;
    struct epoll_event ev = {.events = events, .data.ptr = &c->end[s]};
    if (events == UNWATCHED)
        epoll_ctl(r->ep, EPOLL_CTL_DEL, c->fd[s], NULL);
    else
        epoll_ctl(r->ep, c->events[s] == UNWATCHED ? EPOLL_CTL_ADD : EPOLL_CTL_MOD, c->fd[s], &ev);
    c->events[s] = events;
}

static void report(struct relay *r, uint64_t id, int why) {
    pthread_mutex_lock(&r->mu);
    if (r->n_ended == r->cap_ended) {
        size_t cap = r->cap_ended ? r->cap_ended * 2 : 64;
        struct done *p = realloc(r->ended, cap * sizeof *p);
        if (p) {
            r->ended = p;
            r->cap_ended = cap;
        }
    }
    if (r->n_ended < r->cap_ended)
        r->ended[r->n_ended++] = (struct done){id, why};
    pthread_mutex_unlock(&r->mu);
    uint64_t one = 1;
    ssize_t rc = write(r->notify, &one, sizeof one);
    (void)rc;
}

static void finish(struct relay *r, struct conn *c) {
    for (int s = 0; s < 2; s++) {
        if (c->events[s] != UNWATCHED)
            epoll_ctl(r->ep, EPOLL_CTL_DEL, c->fd[s], NULL);
        close(c->fd[s]);
        free(c->d[s].buf);
        c->d[s].buf = NULL;
    }
    if (c->prev)
        c->prev->next = c->next;
    else
        r->live = c->next;
    if (c->next)
        c->next->prev = c->prev;
    __atomic_sub_fetch(&r->n_live, 1, __ATOMIC_RELAXED);
    if (c->timed)
        r->n_timed--;
    report(r, c->id, c->why);
    /* the batch of events being handled may name c again (its other side) */
    c->dead = 1;
    c->next = r->dead;
    r->dead = c;
}

static void bury(struct relay *r) {
    while (r->dead) {
        struct conn *c = r->dead;
        r->dead = c->next;
        free(c);
    }
}

/* send(2) as much of buf as fd takes now: the count, or -1 on an error. */
static ssize_t put(int fd, const char *buf, size_t len) {
    size_t done = 0;
    while (done < len) {
        ssize_t n = send(fd, buf + done, len - done, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0)
            done += (size_t)n;
        else if (n < 0 && errno == EINTR)
            continue;
        else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            break;
        else
            return -1;
    }
    return (ssize_t)done;
}

/* Write what side s sent and is still kept: 1 when all of it is written,
 * 0 when the other side cannot take more now, -1 on an error. */
static int drain(struct conn *c, int s) {
    struct dir *d = &c->d[s];
    ssize_t n = put(c->fd[1 - s], d->buf + d->off, d->len - d->off);
    if (n < 0)
        return -1;
    d->off += (size_t)n;
    if (d->off < d->len)
        return 0;
    free(d->buf);
    d->buf = NULL;
    d->len = d->off = 0;
    return 1;
}

/* The epoll interest of both sides from the connection's state. */
static void rewatch(struct relay *r, struct conn *c) {
    for (int s = 0; s < 2; s++) {
        uint32_t ev = 0;
        if (!c->closing && c->d[s].len == 0)
            ev |= EPOLLIN | EPOLLRDHUP;   /* read s only while nothing of s is kept */
        if (c->d[1 - s].len)
            ev |= EPOLLOUT;               /* s has to take what the other side sent */
        /* A side with nothing to read or write now is watched for a
         * hang-up only, once (edge-triggered: epoll reports a hang-up
         * whatever it is asked, level-triggered for ever): a side gone
         * while its last bytes wait starts the clock. Closing, it leaves
         * the set. */
        if (ev == 0)
            ev = c->closing ? UNWATCHED : EPOLLRDHUP | EPOLLET;
        watch(r, c, s, ev);
    }
}

static void start_clock(struct relay *r, struct conn *c, int why) {
    if (!c->timed) {
        c->timed = 1;
        c->why = why;
        c->deadline = now_ns() + FLUSH_NS;
        r->n_timed++;
    }
}

static void end_conn(struct relay *r, struct conn *c, int why) {
    if (!c->closing) {
        c->closing = 1;
        if (c->timed && why != END_ERROR)
            why = c->why;   /* the side that hung up first */
        c->why = why;
        start_clock(r, c, why);
    }
    if (why == END_ERROR || (c->d[0].len == 0 && c->d[1].len == 0)) {
        finish(r, c);
        return;
    }
    rewatch(r, c);
}

/* Side s can be read: one read's worth goes to the other side; what that
 * side cannot take now is kept, and s is not read until it is written. */
static void pump(struct relay *r, struct conn *c, int s) {
    ssize_t n;
    do {
        n = recv(c->fd[s], r->scratch, sizeof r->scratch, MSG_DONTWAIT);
    } while (n < 0 && errno == EINTR);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
        return;
    if (n <= 0) {
        end_conn(r, c, n == 0 ? (s == 0 ? END_CLIENT : END_SERVER) : END_ERROR);
        return;
    }
    ssize_t sent = put(c->fd[1 - s], r->scratch, (size_t)n);
    if (sent < 0) {
        end_conn(r, c, END_ERROR);
        return;
    }
    if (sent == n)
        return;
    size_t left = (size_t)(n - sent);
    char *keep = malloc(left);
    if (!keep) {
        end_conn(r, c, END_ERROR);
        return;
    }
    memcpy(keep, r->scratch + sent, left);
    c->d[s] = (struct dir){keep, left, 0};
    rewatch(r, c);
}

static void on_event(struct relay *r, struct end *e, uint32_t events) {
    struct conn *c = e->c;
    int s = e->side;
    if (c->dead)
        return;
    if ((events & EPOLLOUT) && c->d[1 - s].len) {
        int rc = drain(c, 1 - s);
        if (rc < 0) {
            end_conn(r, c, END_ERROR);
            return;
        }
        if (rc == 1) {
            if (c->closing) {
                end_conn(r, c, c->why);
                return;
            }
            rewatch(r, c);
        }
    }
    if (c->closing) {
        /* only a side that still has to take bytes is watched: gone, it never will */
        if (events & (EPOLLHUP | EPOLLERR))
            end_conn(r, c, END_ERROR);
        return;
    }
    if (c->d[s].len) {
        /* not read until its kept bytes are written: it hung up meanwhile */
        if (events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR))
            start_clock(r, c, s == 0 ? END_CLIENT : END_SERVER);
        return;
    }
    if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR))
        pump(r, c, s);
}

static void adopt(struct relay *r, struct conn *c) {
    for (int s = 0; s < 2; s++) {
        c->end[s] = (struct end){c, s};
        c->events[s] = EPOLLIN | EPOLLRDHUP;
        struct epoll_event ev = {.events = c->events[s], .data.ptr = &c->end[s]};
        if (epoll_ctl(r->ep, EPOLL_CTL_ADD, c->fd[s], &ev) < 0) {
            if (s == 1)
                epoll_ctl(r->ep, EPOLL_CTL_DEL, c->fd[0], NULL);
            close(c->fd[0]);
            close(c->fd[1]);
            __atomic_sub_fetch(&r->n_live, 1, __ATOMIC_RELAXED);
            report(r, c->id, END_ERROR);
            free(c);
            return;
        }
    }
    c->prev = NULL;
    c->next = r->live;
    if (r->live)
        r->live->prev = c;
    r->live = c;
}

static void sweep(struct relay *r) {
    long long t = now_ns();
    struct conn *c = r->live;
    while (c) {
        struct conn *next = c->next;
        if (c->timed && t >= c->deadline)
            finish(r, c);   /* the side that had to take the rest did not read it */
        c = next;
    }
}

static void *run(void *arg) {
    struct relay *r = arg;
    struct epoll_event evs[128];
    for (;;) {
        int n = epoll_wait(r->ep, evs, 128, r->n_timed ? 1000 : -1);
        if (n < 0 && errno != EINTR)
            break;
        for (int i = 0; i < n; i++) {
            if (evs[i].data.ptr == (void *)r) {   /* the wake eventfd */
                uint64_t v;
                ssize_t rc = read(r->wake, &v, sizeof v);
                (void)rc;
                continue;
            }
            on_event(r, evs[i].data.ptr, evs[i].events);
        }
        bury(r);
        pthread_mutex_lock(&r->mu);
        struct conn *in = r->incoming;
        r->incoming = NULL;
        int stopping = r->stopping;
        pthread_mutex_unlock(&r->mu);
        while (in) {
            struct conn *next = in->next;
            adopt(r, in);
            in = next;
        }
        if (stopping) {
            while (r->live) {
                r->live->why = END_STOP;
                finish(r, r->live);
            }
            bury(r);
            return NULL;
        }
        if (r->n_timed) {
            sweep(r);
            bury(r);
        }
    }
    return NULL;
}

/* ---- the API control.py calls (ctypes) ---------------------------------- */

/* A relay whose thread runs; notify_fd: an eventfd (or pipe) written once
 * per ended connection. NULL with errno set on failure. */
struct relay *kvc_relay_new(int notify_fd) {
    struct relay *r = calloc(1, sizeof *r);
    if (!r)
        return NULL;
    r->notify = notify_fd;
    r->ep = epoll_create1(EPOLL_CLOEXEC);
    r->wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (r->ep < 0 || r->wake < 0)
        goto fail;
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = r};
    if (epoll_ctl(r->ep, EPOLL_CTL_ADD, r->wake, &ev) < 0)
        goto fail;
    pthread_mutex_init(&r->mu, NULL);
    /* the thread takes no signals: they stay the interpreter's (its main
     * thread, asyncio's handlers) */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(&r->thread, NULL, run, r);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc) {
        errno = rc;
        pthread_mutex_destroy(&r->mu);
        goto fail;
    }
    return r;
fail:;
    int saved = errno;
    if (r->ep >= 0)
        close(r->ep);
    if (r->wake > 0)
        close(r->wake);
    free(r);
    errno = saved;
    return NULL;
}

static void poke(struct relay *r) {
    uint64_t one = 1;
    ssize_t rc = write(r->wake, &one, sizeof one);
    (void)rc;
}

/* Relay between two connected stream sockets, which the relay owns from
 * now on (closed when the connection ends, also on failure here). 0, or -1
 * with errno set. */
int kvc_relay_add(struct relay *r, int client_fd, int server_fd, uint64_t id) {
    struct conn *c = calloc(1, sizeof *c);
    if (!c) {
        close(client_fd);
        close(server_fd);
        errno = ENOMEM;
        return -1;
    }
    c->id = id;
    c->fd[0] = client_fd;
    c->fd[1] = server_fd;
    __atomic_add_fetch(&r->n_live, 1, __ATOMIC_RELAXED);
    pthread_mutex_lock(&r->mu);
    c->next = r->incoming;
    r->incoming = c;
    pthread_mutex_unlock(&r->mu);
    poke(r);
    return 0;
}

/* Ended connections since the last call: up to max (id, why) pairs; their
 * count. why: 0 the client closed, 1 grpcio closed, 2 an error, 3 stopped. */
int kvc_relay_reap(struct relay *r, uint64_t *ids, int *why, int max) {
    pthread_mutex_lock(&r->mu);
    int n = 0;
    while (n < max && (size_t)n < r->n_ended) {
        ids[n] = r->ended[n].id;
        why[n] = r->ended[n].why;
        n++;
    }
    memmove(r->ended, r->ended + n, (r->n_ended - (size_t)n) * sizeof *r->ended);
    r->n_ended -= (size_t)n;
    pthread_mutex_unlock(&r->mu);
    return n;
}

/* Connections handed over and not ended yet. */
int kvc_relay_count(struct relay *r) {
    return (int)__atomic_load_n(&r->n_live, __ATOMIC_RELAXED);
}

/* Close every connection (each is reported, why 3: reap them after this)
 * and stop the thread. */
void kvc_relay_stop(struct relay *r) {
    pthread_mutex_lock(&r->mu);
    int was = r->stopping;
    r->stopping = 1;
    pthread_mutex_unlock(&r->mu);
    if (was)
        return;
    poke(r);
    pthread_join(r->thread, NULL);
    pthread_mutex_lock(&r->mu);
    struct conn *c = r->incoming;   /* handed over after the thread's last look */
    r->incoming = NULL;
    pthread_mutex_unlock(&r->mu);
    while (c) {
        struct conn *next = c->next;
        close(c->fd[0]);
        close(c->fd[1]);
        __atomic_sub_fetch(&r->n_live, 1, __ATOMIC_RELAXED);
        report(r, c->id, END_STOP);
        free(c);
        c = next;
    }
}

/* Stop (if not yet) and free the relay. The notify fd stays the caller's. */
void kvc_relay_free(struct relay *r) {
    kvc_relay_stop(r);
    close(r->ep);
    close(r->wake);
    pthread_mutex_destroy(&r->mu);
    free(r->ended);
    free(r);
}
