/*
 * kvcached-service CUDA test driver: a libcuda.so.1 for machines without a GPU.
 *
 * It implements the subset of the CUDA driver API the project calls, with
 * the prototypes of NVIDIA's own cuda.h (a mismatch does not compile), and
 * enforces the rules the real driver documents. Where the real driver is
 * strict, or where nobody here knows what it does, this driver is strict,
 * each strictness behind a knob (README.md next to this file lists them).
 *
 * Model. "Device memory" is one directory per physical device under a state
 * directory shared by every process of one simulated machine. A page (one
 * cuMemCreate allocation) is a directory `devN/pXXXXXXXX` (XXXXXXXX: the
 * page's key L, unique on the machine) holding one file `data`: the page
 * bytes, then a fixed trailer (magic, device, size, key, a hash of the
 * page's secret, the "still poisoned" bitmap). The references a process
 * holds (its handles and mappings) are slots of its reference table
 * `refs/r<pid>-<random>`, a file it holds flock(LOCK_SH) on while it lives
 * (KVCACHED_TESTDRV_REFS=table, the default: no fd and no mapping per page;
 * the host view of a page is mapped for one memset or copy), or
 * (REFS=fds) one open description of the page directory carrying
 * flock(LOCK_SH) each, with a permanent mmap of `data`. A page is in use
 * device-wide while a live table names it, or a fresh open of its
 * directory cannot take LOCK_EX|LOCK_NB, or (KVCACHED_TESTDRV_FD_IDENTITY=
 * same) some description holds an OFD lock on byte L of the machine's
 * `nvidiactl` directory; otherwise it is garbage and is removed. The kernel
 * drops a dead process's locks, SIGKILL included, so its table reads as
 * dead and its exports stop pinning.
 *
 * Exported fds are never the page bytes: they are directory descriptions
 * (read/pread fail with EISDIR, mmap with ENODEV, nothing can be written)
 * whose file offset holds S = L << 32 | secret. In the default "distinct"
 * identity mode an export is a dup of the page directory description (fstat
 * gives one inode per page); in "same" mode it is a fresh description of the
 * one `nvidiactl` directory with an OFD read lock on byte L (fstat gives the
 * same inode for every export, as an fd of the real driver's device node
 * would). An import checks the offset against the hash in the trailer, so a
 * page directory opened by path (offset 0) cannot be imported.
 *
 * Device virtual addresses are PROT_NONE host reservations (the CPU faults
 * on them, as on a GPU); cuMemcpy and cuMemsetD8 reach the bytes through
 * the page's own host view, and memsets (copies too, with ASYNC=all) land
 * only when the context synchronises.
 */
#define _GNU_SOURCE
#include <cuda.h>

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

/* cuda.h maps cuDeviceGetUuid to cuDeviceGetUuid_v2. The unversioned symbol
 * has the same prototype (non-MIG-aware UUIDs); some callers resolve it by
 * name, so export it too. The prototype is the header's own (its
 * __CUDA_API_VERSION_INTERNAL section). */
#undef cuDeviceGetUuid
__attribute__((visibility("default"))) CUresult CUDAAPI cuDeviceGetUuid(CUuuid *uuid, CUdevice dev);

#define TD_MAX_DEVICES 16
#define TD_HDR 4096u                     /* trailer header (struct td_trailer), one host page */
#define TD_BITMAP 65536u                 /* poison bitmap: one bit per block */
#define TD_TRAILER (TD_HDR + TD_BITMAP)  /* fixed: data's size is page size + TD_TRAILER */
#define TD_BLOCK 4096u                   /* poison block (bigger for pages > 2 GiB) */
#define TD_MAGIC "KVCTDPG2"
#define TD_HANDLE_BASE 0x4b5600000000ull /* handles are BASE + index + 1 */
#define TD_DEFAULT_MEMORY (1ull << 30)
#define TD_DEFAULT_GRANULARITY (2ull << 20)
#define TD_POISON_BYTE 0xdb
#define TD_KEY_DEV_SHIFT 27 /* key L = physical device << 27 | 27 random bits */
#define TD_CTL "nvidiactl"

/* --------------------------------------------------------------------- */
/* error names, generated from cuda.h by scripts/build-testdriver.sh      */

struct td_errname {
    CUresult code;
    const char *name;
    const char *desc;
};
#define TD_ERR(e, d) {e, #e, d},
static const struct td_errname td_errnames[] = {
#include "cu_errors.inc"
};
#undef TD_ERR
#define TD_NERR (sizeof td_errnames / sizeof td_errnames[0])

static const struct td_errname *td_err_lookup(CUresult code) {
    for (size_t i = 0; i < TD_NERR; i++)
        if (td_errnames[i].code == code) return &td_errnames[i];
    return NULL;
}

static const char *td_err_name(CUresult code) {
    const struct td_errname *e = td_err_lookup(code);
    return e ? e->name : "CUDA_ERROR_?";
}

/* --------------------------------------------------------------------- */
/* the functions, for call counting, failure injection and costs          */

#define TD_FUNCS(X)                                                                                            \
    X(cuInit, CUDA_ERROR_NO_DEVICE)                                                                            \
    X(cuDriverGetVersion, CUDA_ERROR_UNKNOWN)                                                                  \
    X(cuDeviceGetCount, CUDA_ERROR_UNKNOWN)                                                                    \
    X(cuDeviceGet, CUDA_ERROR_INVALID_DEVICE)                                                                  \
    X(cuDeviceGetName, CUDA_ERROR_UNKNOWN)                                                                     \
    X(cuDeviceGetUuid, CUDA_ERROR_UNKNOWN)                                                                     \
    X(cuDeviceGetUuid_v2, CUDA_ERROR_UNKNOWN)                                                                  \
    X(cuDeviceGetAttribute, CUDA_ERROR_UNKNOWN)                                                                \
    X(cuDeviceTotalMem_v2, CUDA_ERROR_UNKNOWN)                                                                 \
    X(cuDevicePrimaryCtxRetain, CUDA_ERROR_OUT_OF_MEMORY)                                                      \
    X(cuDevicePrimaryCtxRelease_v2, CUDA_ERROR_UNKNOWN)                                                        \
    X(cuCtxSetCurrent, CUDA_ERROR_INVALID_CONTEXT)                                                             \
    X(cuCtxGetCurrent, CUDA_ERROR_UNKNOWN)                                                                     \
    X(cuCtxGetDevice, CUDA_ERROR_UNKNOWN)                                                                      \
    X(cuCtxSynchronize, CUDA_ERROR_UNKNOWN)                                                                    \
    X(cuMemGetInfo_v2, CUDA_ERROR_UNKNOWN)                                                                     \
    X(cuMemGetAllocationGranularity, CUDA_ERROR_UNKNOWN)                                                       \
    X(cuMemCreate, CUDA_ERROR_OUT_OF_MEMORY)                                                                   \
    X(cuMemRelease, CUDA_ERROR_UNKNOWN)                                                                        \
    X(cuMemExportToShareableHandle, CUDA_ERROR_UNKNOWN)                                                        \
    X(cuMemImportFromShareableHandle, CUDA_ERROR_UNKNOWN)                                                      \
    X(cuMemAddressReserve, CUDA_ERROR_OUT_OF_MEMORY)                                                           \
    X(cuMemAddressFree, CUDA_ERROR_UNKNOWN)                                                                    \
    X(cuMemMap, CUDA_ERROR_OUT_OF_MEMORY)                                                                      \
    X(cuMemUnmap, CUDA_ERROR_UNKNOWN)                                                                          \
    X(cuMemSetAccess, CUDA_ERROR_UNKNOWN)                                                                      \
    X(cuMemsetD8_v2, CUDA_ERROR_UNKNOWN)                                                                       \
    X(cuMemcpyHtoD_v2, CUDA_ERROR_UNKNOWN)                                                                     \
    X(cuMemcpyDtoH_v2, CUDA_ERROR_UNKNOWN)                                                                     \
    X(cuStreamCreate, CUDA_ERROR_UNKNOWN)                                                                      \
    X(cuStreamDestroy_v2, CUDA_ERROR_UNKNOWN)                                                                  \
    X(cuStreamSynchronize, CUDA_ERROR_UNKNOWN)                                                                 \
    X(cuMemsetD8Async, CUDA_ERROR_UNKNOWN)                                                                     \
    X(cuEventCreate, CUDA_ERROR_UNKNOWN)                                                                       \
    X(cuEventRecord, CUDA_ERROR_UNKNOWN)                                                                       \
    X(cuEventQuery, CUDA_ERROR_UNKNOWN)                                                                        \
    X(cuEventSynchronize, CUDA_ERROR_UNKNOWN)                                                                  \
    X(cuEventDestroy_v2, CUDA_ERROR_UNKNOWN)                                                                   \
    X(cuGetErrorName, CUDA_ERROR_INVALID_VALUE)                                                                \
    X(cuGetErrorString, CUDA_ERROR_INVALID_VALUE)

#define TD_ENUM(f, e) FN_##f,
enum td_fn { TD_FUNCS(TD_ENUM) FN__COUNT };
#undef TD_ENUM
#define TD_NAME(f, e) #f,
static const char *const td_fn_names[] = {TD_FUNCS(TD_NAME)};
#undef TD_NAME
#define TD_DEFERR(f, e) e,
static const CUresult td_fn_default_err[] = {TD_FUNCS(TD_DEFERR)};
#undef TD_DEFERR

struct td_fail_rule {
    int fn;
    unsigned long nth;
    bool and_after; /* "cuMemMap:3+" fails the 3rd call and every later one */
    CUresult code;
};

struct td_injected {
    int fn;
    unsigned long call;
    CUresult code;
};

/* --------------------------------------------------------------------- */
/* process state (all of it under g_lock)                                 */

enum td_fdmode { FD_DISTINCT, FD_SAME, FD_FILE, FD_CHR };
enum td_async { ASYNC_OFF, ASYNC_MEMSET, ASYNC_ALL };
enum td_poison { POISON_OFF, POISON_EDGES, POISON_FULL };
enum td_refs { REFS_TABLE, REFS_FDS };

struct td_machine;

struct td_alloc { /* 56 bytes (a 64-byte malloc chunk): a process may hold 100k of them */
    struct td_machine *m;     /* the simulated machine the page belongs to */
    size_t size;              /* page bytes (the poison block is block_for(size)) */
    unsigned char *host;      /* REFS=fds: MAP_SHARED view of data (page bytes + trailer); NULL with REFS=table */
    uint64_t secret;          /* S = L << 32 | secret bits: what exports carry */
    ino_t st_ino;             /* of the page directory (on the machine's file system) */
    uint32_t key;             /* L */
    int refs;                 /* handles + mappings in this process */
    int dirfd;                /* REFS=fds: the page directory: LOCK_SH, file offset S (-1 with REFS=table) */
    uint8_t phys;             /* physical device index */
    bool exportable;          /* created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR */
    bool refd;                /* REFS=table: holds a reference in its machine's table */
    bool imported;            /* its handle came from cuMemImportFromShareableHandle */
};
_Static_assert(sizeof(struct td_alloc) <= 56, "td_alloc: keep it in a 64-byte malloc chunk");

struct td_handle { /* 8 bytes: one per handle ever made */
    struct td_alloc *alloc; /* NULL once released (each handle has an alloc of its own) */
};

struct td_map {
    uintptr_t va;
    size_t size;
    struct td_alloc *alloc;
    unsigned char access[TD_MAX_DEVICES]; /* CUmemAccess_flags per physical device */
};

struct td_resv {
    uintptr_t base;
    size_t size;
    size_t nslots;
    struct td_map **slots; /* one per granule */
};

struct td_export {
    int fd;
    dev_t st_dev;
    ino_t st_ino;
    uint64_t secret; /* the offset the description must still have (directory modes) */
    CUmemGenericAllocationHandle handle;
    size_t size;
    int phys;
};

enum td_opkind { OP_READ, OP_WRITE, OP_SET };

struct td_op { /* a memset or copy issued but not landed yet */
    enum td_opkind kind;
    uintptr_t va;
    size_t n;
    unsigned char val;
    unsigned char *data; /* OP_WRITE: the bytes, copied at issue time */
};

struct td_queue { /* work issued on one stream, in issue order */
    struct td_op *ops;
    size_t nops, capops;
};

struct CUctx_st {
    uint32_t magic;
    int ordinal;
    int phys;
    int refcount;
    bool active;
    int overhead_fd;         /* the context's hidden device memory (KVCACHED_TESTDRV_CONTEXT_BYTES) */
    uint32_t overhead_key;
    struct td_queue q;       /* pending work of the context's own (NULL) stream */
};
#define TD_CTX_MAGIC 0x6b766378u

struct td_trailer {
    char magic[8];
    uint32_t phys;
    uint32_t version;
    uint64_t size;
    uint32_t key;
    uint32_t reserved;
    uint64_t block;       /* poison block size; bit i of the bitmap covers block i */
    uint64_t secret_hash; /* td_hash(S): an import's offset must hash to it */
    unsigned char uuid[16];
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

static struct {
    bool loaded;
    char config_error[512];
    int nphys;
    size_t memory;
    size_t gran;
    unsigned char uuid[TD_MAX_DEVICES][16];
    bool no_vmm[TD_MAX_DEVICES];
    bool no_posix_fd[TD_MAX_DEVICES];
    enum td_poison poison;
    enum td_fdmode fdmode;
    enum td_async async;
    enum td_refs refs;
    bool fork_refuse;
    bool peer[TD_MAX_DEVICES][TD_MAX_DEVICES]; /* peer[a][b]: a may access b's memory */
    size_t ctx_bytes;
    size_t other[TD_MAX_DEVICES];
    uint64_t cost_ns[FN__COUNT]; /* per granule for create/map/unmap/set-access, else per call */
    char state[PATH_MAX];
    char report[PATH_MAX]; /* KVCACHED_TESTDRV_REPORT as given; %p becomes the pid when written */
    int nvis;
    int vis[TD_MAX_DEVICES]; /* ordinal -> physical index */
    struct td_fail_rule rules[64];
    int nrules;
} cfg;

static bool g_inited;
static bool g_forked; /* this process is a fork() child of one that had called cuInit */
static unsigned long g_calls[FN__COUNT];
static struct td_injected g_injected[256];
static int g_ninjected;
static struct CUctx_st g_ctx[TD_MAX_DEVICES]; /* by ordinal */
static __thread struct CUctx_st *t_current;

static struct td_handle *g_handles;
static size_t g_nhandles, g_caphandles, g_livehandles;
static struct td_resv **g_resv;
static size_t g_nresv, g_capresv;
static size_t g_livemaps;
static struct td_export *g_exports;
static size_t g_nexports, g_capexports, g_exports_pruned_at;
static int g_lockfd[TD_MAX_DEVICES] = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
static int g_devfd[TD_MAX_DEVICES] = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
static unsigned long g_lost_ops; /* memsets/copies dropped: unmapped or context destroyed before a sync */
static long g_pagesize;

#define LOCK() pthread_mutex_lock(&g_lock)
#define UNLOCK() pthread_mutex_unlock(&g_lock)

static void td_warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void td_warn(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("kvcached testdriver: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

/* --------------------------------------------------------------------- */
/* configuration                                                          */

static bool parse_size(const char *s, size_t *out) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || end == s) return false;
    while (*end == ' ') end++;
    unsigned long long mul = 1;
    if (*end) {
        char u = (char)toupper((unsigned char)*end);
        if (u == 'K') mul = 1ull << 10;
        else if (u == 'M') mul = 1ull << 20;
        else if (u == 'G') mul = 1ull << 30;
        else if (u == 'T') mul = 1ull << 40;
        else return false;
        end++;
        if (*end == 'i' || *end == 'I') end++;
        if (*end == 'B' || *end == 'b') end++;
        if (*end) return false;
    }
    *out = (size_t)(v * mul);
    return true;
}

static bool parse_uuid(const char *s, unsigned char out[16]) {
    if (strncmp(s, "GPU-", 4) == 0) s += 4;
    int n = 0;
    for (; *s && n < 32; s++) {
        if (*s == '-') continue;
        if (!isxdigit((unsigned char)*s)) return false;
        int v = isdigit((unsigned char)*s) ? *s - '0' : (tolower((unsigned char)*s) - 'a' + 10);
        if (n % 2 == 0) out[n / 2] = (unsigned char)(v << 4);
        else out[n / 2] |= (unsigned char)v;
        n++;
    }
    return n == 32 && *s == 0;
}

static void format_uuid(const unsigned char u[16], char out[41]) {
    snprintf(out, 41, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1], u[2],
             u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
}

static bool parse_error_code(const char *s, CUresult *out) {
    char *end;
    long v = strtol(s, &end, 10);
    if (end != s && *end == 0) {
        *out = (CUresult)v;
        return true;
    }
    for (size_t i = 0; i < TD_NERR; i++)
        if (strcmp(td_errnames[i].name, s) == 0) {
            *out = td_errnames[i].code;
            return true;
        }
    return false;
}

/* "1" / "all" -> every device; "dev0,dev2" (or "0,2" with more than one
 * entry) -> those physical devices. */
static bool parse_devset(const char *s, bool out[TD_MAX_DEVICES]) {
    memset(out, 0, sizeof(bool) * TD_MAX_DEVICES);
    if (!s || !*s || strcmp(s, "0") == 0) return true;
    if (strcmp(s, "1") == 0 || strcmp(s, "all") == 0) {
        for (int i = 0; i < TD_MAX_DEVICES; i++) out[i] = true;
        return true;
    }
    char buf[256];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (strncmp(tok, "dev", 3) == 0) tok += 3;
        char *end;
        long v = strtol(tok, &end, 10);
        if (end == tok || *end || v < 0 || v >= TD_MAX_DEVICES) return false;
        out[v] = true;
    }
    return true;
}

static void config_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void config_fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    if (!cfg.config_error[0]) vsnprintf(cfg.config_error, sizeof cfg.config_error, fmt, ap);
    va_end(ap);
}

/* One of `names` (the index), or -1. */
static int parse_choice(const char *s, const char *const *names, int n) {
    for (int i = 0; i < n; i++)
        if (strcmp(s, names[i]) == 0) return i;
    return -1;
}

/* "none", "all", or pairs "0-1,2-3" (symmetric; a device is always its own peer). */
static bool parse_peers(const char *s) {
    memset(cfg.peer, 0, sizeof cfg.peer);
    for (int i = 0; i < TD_MAX_DEVICES; i++) cfg.peer[i][i] = true;
    if (!s || !*s || strcmp(s, "none") == 0 || strcmp(s, "0") == 0) return true;
    if (strcmp(s, "all") == 0 || strcmp(s, "1") == 0) {
        memset(cfg.peer, 1, sizeof cfg.peer);
        return true;
    }
    char buf[256];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        char *end;
        long a = strtol(tok, &end, 10);
        if (end == tok || *end != '-') return false;
        char *b0 = end + 1;
        long b = strtol(b0, &end, 10);
        if (end == b0 || *end || a < 0 || b < 0 || a >= TD_MAX_DEVICES || b >= TD_MAX_DEVICES) return false;
        cfg.peer[a][b] = cfg.peer[b][a] = true;
    }
    return true;
}

/* "cuMemCreate=193,cuMemMap=1.5,..." (microseconds) or "a100": kvcached's
 * per-2-MiB-page numbers measured on an A100 (bench_vmm). */
static bool parse_costs(const char *s) {
    if (strcmp(s, "a100") == 0) s = "cuMemCreate=193,cuMemMap=1.5,cuMemSetAccess=36,cuMemUnmap=26";
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(tok, '=');
        if (!eq) return false;
        *eq = 0;
        int fn = -1;
        for (int f = 0; f < FN__COUNT; f++)
            if (strcmp(td_fn_names[f], tok) == 0) fn = f;
        char *end;
        double us = strtod(eq + 1, &end);
        if (fn < 0 || end == eq + 1 || *end || us < 0 || us > 10e6) return false;
        cfg.cost_ns[fn] = (uint64_t)(us * 1000.0);
    }
    return true;
}

/* Live call counters (KVCACHED_TESTDRV_CALLS=DIR): each process keeps its
 * per-function counts in the file DIR/<pid>, mapped shared and updated with
 * relaxed atomics (no syscall per call), so a reader may snapshot it at any
 * moment, also after the process exited (bench/drivercalls.py reads it).
 * Layout (little-endian, offsets in bytes):
 *   0  u64 magic TD_LIVE_MAGIC (stored last, with release order)
 *   8  u32 version (1), u32 nfn, u32 thread slots, u32 name length (48)
 *   24 u32 pid, u32 thread slots taken (more threads count in the totals only)
 *   32 char names[nfn][48]
 *   then u64 calls[nfn], u64 bytes[nfn] (the process's totals)
 *   then per thread slot: u32 tid, u32 0, char comm[16], u64 calls[nfn], u64 bytes[nfn]
 * `bytes` sums the size argument of the calls that take one (cuMemCreate,
 * cuMemMap, cuMemUnmap, cuMemSetAccess): the pages the calls covered. Every call counts, including failed ones. A fork() child starts
 * a file of its own. */
#define TD_LIVE_MAGIC 0x314c4e4344565444ull /* "DTVDCNL1" */
#define TD_LIVE_THREADS 32
#define TD_LIVE_NAME 48
struct td_live_thread {
    uint32_t tid, zero;
    char comm[16];
    uint64_t c[]; /* calls[nfn], then bytes[nfn] */
};
static char g_live_dir[PATH_MAX];
static unsigned char *g_live;   /* the mapped file, NULL: not counting */
static size_t g_live_size;
static unsigned g_live_gen;     /* changes when the file does (fork) */
static __thread unsigned t_live_gen;
static __thread struct td_live_thread *t_live;

#define TD_LIVE_HEAD 32
#define TD_LIVE_TOTALS (TD_LIVE_HEAD + (size_t)FN__COUNT * TD_LIVE_NAME)
#define TD_LIVE_SLOT (sizeof(struct td_live_thread) + 2 * (size_t)FN__COUNT * sizeof(uint64_t))
#define TD_LIVE_SLOTS (TD_LIVE_TOTALS + 2 * (size_t)FN__COUNT * sizeof(uint64_t))

static bool td_live_open(void) {
    if (g_live) munmap(g_live, g_live_size);
    g_live = NULL;
    g_live_gen++;
    if (!g_live_dir[0]) return true;
    char path[PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/%d", g_live_dir, (int)getpid());
    (void)mkdir(g_live_dir, 0777);
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    size_t size = TD_LIVE_SLOTS + TD_LIVE_THREADS * TD_LIVE_SLOT;
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
        if (fd >= 0) close(fd);
        return false;
    }
    unsigned char *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return false;
    uint32_t head[6] = {1, FN__COUNT, TD_LIVE_THREADS, TD_LIVE_NAME, (uint32_t)getpid(), 0};
    memcpy(p + 8, head, sizeof head);
    for (int f = 0; f < FN__COUNT; f++) snprintf((char *)p + TD_LIVE_HEAD + (size_t)f * TD_LIVE_NAME, TD_LIVE_NAME, "%s", td_fn_names[f]);
    __atomic_store_n((uint64_t *)p, TD_LIVE_MAGIC, __ATOMIC_RELEASE);
    g_live = p;
    g_live_size = size;
    return true;
}

static void td_live_add(int fn, uint64_t calls, uint64_t bytes) {
    unsigned char *p = g_live;
    if (!p) return;
    uint64_t *tot = (uint64_t *)(p + TD_LIVE_TOTALS);
    if (calls) __atomic_fetch_add(&tot[fn], calls, __ATOMIC_RELAXED);
    if (bytes) __atomic_fetch_add(&tot[FN__COUNT + fn], bytes, __ATOMIC_RELAXED);
    if (t_live_gen != g_live_gen) { /* this thread's first call (in this file): take a slot */
        t_live_gen = g_live_gen;
        t_live = NULL;
        uint32_t i = __atomic_fetch_add((uint32_t *)(p + 28), 1, __ATOMIC_RELAXED);
        if (i < TD_LIVE_THREADS) {
            struct td_live_thread *t = (struct td_live_thread *)(p + TD_LIVE_SLOTS + i * TD_LIVE_SLOT);
            char comm[16] = {0};
            (void)pthread_getname_np(pthread_self(), comm, sizeof comm);
            memcpy(t->comm, comm, sizeof comm);
            __atomic_store_n(&t->tid, (uint32_t)gettid(), __ATOMIC_RELEASE);
            t_live = t;
        }
    }
    if (t_live) {
        if (calls) __atomic_fetch_add(&t_live->c[fn], calls, __ATOMIC_RELAXED);
        if (bytes) __atomic_fetch_add(&t_live->c[FN__COUNT + fn], bytes, __ATOMIC_RELAXED);
    }
}

#ifdef KVCACHED_TESTDRV_PUBLIC_ONLY
/* Built without its private features (scripts/build-testdriver.sh
 * --public-only): no KVCACHED_TESTDRV_* variable is read (knobs, state
 * directory, leak report, fault injection), as with NVIDIA's driver; only
 * CUDA_VISIBLE_DEVICES. The suites pointed at it (KVCACHED_TEST_LIBCUDA)
 * must skip what needs those features and pass the rest. One machine per
 * uid with 4 GiB per device, strict defaults. */
static char *td_getenv(const char *name) {
    return strncmp(name, "KVCACHED_TESTDRV_", 17) == 0 ? NULL : getenv(name);
}
#define getenv td_getenv
#undef TD_DEFAULT_MEMORY
#define TD_DEFAULT_MEMORY (4ull << 30)
#define TD_STATE_FMT "/dev/shm/kvcached-testdrv-public-%u"
#else
#define TD_STATE_FMT "/dev/shm/kvcached-testdrv-%u"
#endif

static void load_config(void) {
    const char *s;
    g_pagesize = sysconf(_SC_PAGESIZE);
    cfg.nphys = 1;
    if ((s = getenv("KVCACHED_TESTDRV_DEVICES")) && *s) {
        char *end;
        long v = strtol(s, &end, 10);
        if (*end || v < 0 || v > TD_MAX_DEVICES) config_fail("KVCACHED_TESTDRV_DEVICES=%s: want 0..%d", s, TD_MAX_DEVICES);
        else cfg.nphys = (int)v;
    }
    cfg.memory = TD_DEFAULT_MEMORY;
    if ((s = getenv("KVCACHED_TESTDRV_MEMORY")) && *s && !parse_size(s, &cfg.memory))
        config_fail("KVCACHED_TESTDRV_MEMORY=%s: want bytes (suffix K/M/G allowed)", s);
    cfg.gran = TD_DEFAULT_GRANULARITY;
    if ((s = getenv("KVCACHED_TESTDRV_GRANULARITY")) && *s && !parse_size(s, &cfg.gran))
        config_fail("KVCACHED_TESTDRV_GRANULARITY=%s: want bytes", s);
    if (cfg.gran == 0 || (cfg.gran & (cfg.gran - 1)) || cfg.gran % (size_t)g_pagesize)
        config_fail("KVCACHED_TESTDRV_GRANULARITY=%zu: want a power of two multiple of the host page size", cfg.gran);

    for (int i = 0; i < TD_MAX_DEVICES; i++) {
        static const unsigned char base[16] = {0x7e, 0x57, 0xd7, 0x1e, 0x00, 0x00, 0x40, 0x00,
                                               0x80, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00};
        memcpy(cfg.uuid[i], base, 16);
        cfg.uuid[i][5] = (unsigned char)i; /* GPU-7e57d71e-000N-4000-8000-00000000000N */
        cfg.uuid[i][15] = (unsigned char)i;
    }
    if ((s = getenv("KVCACHED_TESTDRV_UUIDS")) && *s) {
        char buf[TD_MAX_DEVICES * 48];
        snprintf(buf, sizeof buf, "%s", s);
        int i = 0;
        for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok && i < TD_MAX_DEVICES;
             tok = strtok_r(NULL, ",", &save), i++)
            if (!parse_uuid(tok, cfg.uuid[i])) config_fail("KVCACHED_TESTDRV_UUIDS: bad UUID '%s'", tok);
    }
    if (!parse_devset(getenv("KVCACHED_TESTDRV_NO_VMM"), cfg.no_vmm))
        config_fail("KVCACHED_TESTDRV_NO_VMM=%s: want 1, all or dev0,dev1,...", getenv("KVCACHED_TESTDRV_NO_VMM"));
    if (!parse_devset(getenv("KVCACHED_TESTDRV_NO_POSIX_FD"), cfg.no_posix_fd))
        config_fail("KVCACHED_TESTDRV_NO_POSIX_FD=%s: want 1, all or dev0,dev1,...",
                    getenv("KVCACHED_TESTDRV_NO_POSIX_FD"));

    /* Strictness. A profile sets every knob at once; a knob set on its own wins. */
    cfg.poison = POISON_FULL;
    cfg.fdmode = FD_CHR; /* as NVIDIA's driver does (one /dev/nvidiactl inode for every export; seen on an H200) */
    cfg.async = ASYNC_MEMSET;
    cfg.fork_refuse = true;
    const char *peers = "none";
    if ((s = getenv("KVCACHED_TESTDRV_STRICT")) && *s) {
        if (strcmp(s, "lenient") == 0) { /* the driver before issue 17: for comparisons */
            cfg.poison = POISON_EDGES;
            cfg.fdmode = FD_FILE;
            cfg.async = ASYNC_OFF;
            cfg.fork_refuse = false;
            peers = "all";
        } else if (strcmp(s, "max") == 0) {
            cfg.fdmode = FD_SAME;
            cfg.async = ASYNC_ALL;
        } else if (strcmp(s, "default") != 0) {
            config_fail("KVCACHED_TESTDRV_STRICT=%s: want default, max or lenient", s);
        }
    }
    static const char *const poison_names[] = {"0", "edges", "full", "1"};
    if ((s = getenv("KVCACHED_TESTDRV_POISON")) && *s) {
        int v = parse_choice(s, poison_names, 4);
        if (v < 0) config_fail("KVCACHED_TESTDRV_POISON=%s: want full (or 1), edges or 0", s);
        else cfg.poison = v == 3 ? POISON_FULL : (enum td_poison)v;
    }
    static const char *const fd_names[] = {"distinct", "same", "file", "chardev"};
    if ((s = getenv("KVCACHED_TESTDRV_FD_IDENTITY")) && *s) {
        int v = parse_choice(s, fd_names, 4);
        if (v < 0) config_fail("KVCACHED_TESTDRV_FD_IDENTITY=%s: want distinct, same, file or chardev", s);
        else cfg.fdmode = (enum td_fdmode)v;
    }
#ifdef KVCACHED_TESTDRV_PUBLIC_ONLY
    cfg.fdmode = FD_CHR; /* as NVIDIA's driver most likely does (an fd of /dev/nvidiactl) */
#endif
    static const char *const async_names[] = {"0", "memset", "all"};
    if ((s = getenv("KVCACHED_TESTDRV_ASYNC")) && *s) {
        int v = parse_choice(s, async_names, 3);
        if (v < 0) config_fail("KVCACHED_TESTDRV_ASYNC=%s: want memset, all or 0", s);
        else cfg.async = (enum td_async)v;
    }
    static const char *const fork_names[] = {"refuse", "allow"};
    if ((s = getenv("KVCACHED_TESTDRV_FORK")) && *s) {
        int v = parse_choice(s, fork_names, 2);
        if (v < 0) config_fail("KVCACHED_TESTDRV_FORK=%s: want refuse or allow", s);
        else cfg.fork_refuse = v == 0;
    }
    /* How a process's references to pages are kept (not a strictness: both
     * models have the same semantics; README.md, "The model"). */
    cfg.refs = REFS_TABLE;
    static const char *const refs_names[] = {"table", "fds"};
    if ((s = getenv("KVCACHED_TESTDRV_REFS")) && *s) {
        int v = parse_choice(s, refs_names, 2);
        if (v < 0) config_fail("KVCACHED_TESTDRV_REFS=%s: want table or fds", s);
        else cfg.refs = (enum td_refs)v;
    }
    if ((s = getenv("KVCACHED_TESTDRV_PEERS")) && *s) peers = s;
    if (!parse_peers(peers)) config_fail("KVCACHED_TESTDRV_PEERS=%s: want none, all or pairs like 0-1,2-3", peers);
    if ((s = getenv("KVCACHED_TESTDRV_CONTEXT_BYTES")) && *s && !parse_size(s, &cfg.ctx_bytes))
        config_fail("KVCACHED_TESTDRV_CONTEXT_BYTES=%s: want bytes", s);
    if (cfg.ctx_bytes % (size_t)g_pagesize) cfg.ctx_bytes += (size_t)g_pagesize - cfg.ctx_bytes % (size_t)g_pagesize;
    if ((s = getenv("KVCACHED_TESTDRV_OTHER_BYTES")) && *s) {
        /* "512M" (every device) or "dev0:512M,dev2:1G" */
        size_t v;
        if (!strchr(s, ':')) {
            if (!parse_size(s, &v)) config_fail("KVCACHED_TESTDRV_OTHER_BYTES=%s: want bytes or devN:bytes,...", s);
            else
                for (int i = 0; i < TD_MAX_DEVICES; i++) cfg.other[i] = v;
        } else {
            char buf[512];
            snprintf(buf, sizeof buf, "%s", s);
            for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
                char *c = strchr(tok, ':');
                if (c) *c = 0;
                const char *d = strncmp(tok, "dev", 3) == 0 ? tok + 3 : tok;
                char *end;
                long dev = strtol(d, &end, 10);
                if (!c || end == d || *end || dev < 0 || dev >= TD_MAX_DEVICES || !parse_size(c + 1, &v)) {
                    config_fail("KVCACHED_TESTDRV_OTHER_BYTES=%s: want bytes or devN:bytes,...", s);
                    break;
                }
                cfg.other[dev] = v;
            }
        }
    }
    if ((s = getenv("KVCACHED_TESTDRV_COST")) && *s && !parse_costs(s))
        config_fail("KVCACHED_TESTDRV_COST=%s: want a100 or function=microseconds,...", s);
    if ((s = getenv("KVCACHED_TESTDRV_CREATE_US")) && *s) {
        char *end;
        double us = strtod(s, &end);
        if (end == s || *end || us < 0 || us > 10e6) config_fail("KVCACHED_TESTDRV_CREATE_US=%s: want microseconds", s);
        else cfg.cost_ns[FN_cuMemCreate] = (uint64_t)(us * 1000.0);
    }

    if ((s = getenv("KVCACHED_TESTDRV_STATE")) && *s) snprintf(cfg.state, sizeof cfg.state, "%s", s);
    else snprintf(cfg.state, sizeof cfg.state, TD_STATE_FMT, (unsigned)getuid());
    if (strlen(cfg.state) > PATH_MAX - 160) config_fail("KVCACHED_TESTDRV_STATE is too long");

    if ((s = getenv("KVCACHED_TESTDRV_REPORT")) && *s) snprintf(cfg.report, sizeof cfg.report, "%s", s);
    if ((s = getenv("KVCACHED_TESTDRV_CALLS")) && *s) {
        snprintf(g_live_dir, sizeof g_live_dir, "%s", s);
        if (strlen(s) > PATH_MAX - 32 || !td_live_open())
            config_fail("KVCACHED_TESTDRV_CALLS=%s: cannot make the counter file there (%s)", s, strerror(errno));
    }

    if ((s = getenv("KVCACHED_TESTDRV_FAIL")) && *s) {
        char buf[2048];
        snprintf(buf, sizeof buf, "%s", s);
        for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
            char *c1 = strchr(tok, ':');
            if (!c1) {
                config_fail("KVCACHED_TESTDRV_FAIL: '%s': want function:N[+][:CUDA_ERROR_NAME]", tok);
                break;
            }
            *c1 = 0;
            char *c2 = strchr(c1 + 1, ':');
            if (c2) *c2 = 0;
            struct td_fail_rule r = {.fn = -1};
            for (int f = 0; f < FN__COUNT; f++)
                if (strcmp(td_fn_names[f], tok) == 0) r.fn = f;
            char *end;
            r.nth = strtoul(c1 + 1, &end, 10);
            if (*end == '+') {
                r.and_after = true;
                end++;
            }
            if (r.fn < 0 || r.nth == 0 || *end) {
                config_fail("KVCACHED_TESTDRV_FAIL: '%s:%s': unknown function or bad call number", tok, c1 + 1);
                break;
            }
            r.code = td_fn_default_err[r.fn];
            if (c2 && !parse_error_code(c2 + 1, &r.code)) {
                config_fail("KVCACHED_TESTDRV_FAIL: unknown error '%s'", c2 + 1);
                break;
            }
            if (cfg.nrules < (int)(sizeof cfg.rules / sizeof cfg.rules[0])) cfg.rules[cfg.nrules++] = r;
        }
    }

    /* CUDA_VISIBLE_DEVICES: indices or UUIDs (prefixes allowed); the list
     * ends at the first entry that does not name a device, as with the real
     * driver. */
    s = getenv("CUDA_VISIBLE_DEVICES");
    cfg.nvis = 0;
    if (!s) {
        for (int i = 0; i < cfg.nphys; i++) cfg.vis[cfg.nvis++] = i;
    } else {
        char buf[1024];
        snprintf(buf, sizeof buf, "%s", s);
        for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok && cfg.nvis < TD_MAX_DEVICES;
             tok = strtok_r(NULL, ",", &save)) {
            while (*tok == ' ') tok++;
            int phys = -1;
            if (strncmp(tok, "GPU-", 4) == 0) {
                int matches = 0;
                for (int i = 0; i < cfg.nphys; i++) {
                    char u[41];
                    format_uuid(cfg.uuid[i], u);
                    if (strncasecmp(u, tok, strlen(tok)) == 0) {
                        phys = i;
                        matches++;
                    }
                }
                if (matches != 1) phys = -1;
            } else {
                char *end;
                long v = strtol(tok, &end, 10);
                if (end != tok && *end == 0 && v >= 0 && v < cfg.nphys) phys = (int)v;
            }
            if (phys < 0) break;
            bool dup = false;
            for (int i = 0; i < cfg.nvis; i++) dup |= cfg.vis[i] == phys;
            if (dup) break;
            cfg.vis[cfg.nvis++] = phys;
        }
    }
    for (int o = 0; o < TD_MAX_DEVICES; o++) {
        g_ctx[o].magic = TD_CTX_MAGIC;
        g_ctx[o].ordinal = o;
        g_ctx[o].phys = o < cfg.nvis ? cfg.vis[o] : -1;
        g_ctx[o].overhead_fd = -1;
    }
    cfg.loaded = true;
}

/* --------------------------------------------------------------------- */
/* small helpers                                                          */

static CUresult td_enter(int fn) {
    unsigned long n = ++g_calls[fn];
    td_live_add(fn, 1, 0);
    for (int i = 0; i < cfg.nrules; i++) {
        struct td_fail_rule *r = &cfg.rules[i];
        if (r->fn == fn && (n == r->nth || (r->and_after && n > r->nth))) {
            if (g_ninjected < (int)(sizeof g_injected / sizeof g_injected[0]))
                g_injected[g_ninjected++] = (struct td_injected){fn, n, r->code};
            return r->code;
        }
    }
    return CUDA_SUCCESS;
}

/* A forked child of a process that initialised the driver gets nothing: the
 * real driver's state does not survive fork() (its CUDA runtime reports an
 * initialization error there). */
#define ENTER(fn)                                          \
    LOCK();                                                \
    CUresult _inj = td_enter(FN_##fn);                     \
    if (_inj != CUDA_SUCCESS) {                            \
        UNLOCK();                                          \
        return _inj;                                       \
    }                                                      \
    if (!g_inited || g_forked) {                           \
        UNLOCK();                                          \
        return CUDA_ERROR_NOT_INITIALIZED;                 \
    }
#define RETURN(code)    \
    do {                \
        CUresult _r = (code); \
        UNLOCK();       \
        return _r;      \
    } while (0)

/* The configured cost of a call: slept (or, below 50 us, spun) before the
 * call takes the driver's lock, so threads of one process overlap as they
 * would on a real driver. */
static void td_cost(int fn, size_t bytes) {
    if (bytes) td_live_add(fn, 0, bytes);
    uint64_t ns = cfg.cost_ns[fn];
    if (!ns) return;
    if (bytes) ns *= (bytes + cfg.gran - 1) / cfg.gran;
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (ns >= 50000) {
        struct timespec d = {(time_t)(ns / 1000000000u), (long)(ns % 1000000000u)};
        while (clock_nanosleep(CLOCK_MONOTONIC, 0, &d, &d) == EINTR) {
        }
        return;
    }
    do {
        clock_gettime(CLOCK_MONOTONIC, &now);
    } while ((uint64_t)(now.tv_sec - t0.tv_sec) * 1000000000u + (uint64_t)(now.tv_nsec - t0.tv_nsec) < ns);
}

static bool valid_ordinal(CUdevice dev) { return dev >= 0 && dev < cfg.nvis; }

static CUresult need_ctx(struct CUctx_st **out) {
    struct CUctx_st *c = t_current;
    if (!c || !c->active) return CUDA_ERROR_INVALID_CONTEXT;
    *out = c;
    return CUDA_SUCCESS;
}

static int ordinal_of_phys(int phys) {
    for (int o = 0; o < cfg.nvis; o++)
        if (cfg.vis[o] == phys) return o;
    return -1;
}

static void devdir(int phys, char *out, size_t n) { snprintf(out, n, "%s/dev%d", cfg.state, phys); }

static int mkdir_p(const char *path, mode_t mode) {
    char buf[PATH_MAX];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *p = buf + 1; *p; p++) {
        if (*p == '/') {
            *p = 0;
            if (mkdir(buf, mode) != 0 && errno != EEXIST) return -1;
            *p = '/';
        }
    }
    if (mkdir(buf, mode) != 0 && errno != EEXIST) return -1;
    return 0;
}

static uint64_t td_random(void) {
    uint64_t v = 0;
    if (getrandom(&v, sizeof v, 0) != (ssize_t)sizeof v) {
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        v = ((uint64_t)t.tv_nsec << 20) ^ (uint64_t)getpid() ^ ((uint64_t)t.tv_sec << 40);
    }
    return v;
}

/* What the trailer stores about a page's secret S: a one-way-ish mix (the
 * Davies-Meyer shape over a 64-bit finaliser). Not cryptography: it keeps
 * code that opens a page directory by path from importing it, nothing more. */
static uint64_t td_hash(uint64_t s) {
    uint64_t x = s ^ 0x6b76636163686564ull;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x ^ s;
}

static void page_name(uint32_t key, char out[16]) { snprintf(out, 16, "p%08x", key); }

static int dev_dirfd(int phys) {
    if (g_devfd[phys] < 0) {
        char dir[PATH_MAX];
        devdir(phys, dir, sizeof dir);
        g_devfd[phys] = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    }
    return g_devfd[phys];
}

static size_t capacity(int phys) { return cfg.other[phys] >= cfg.memory ? 0 : cfg.memory - cfg.other[phys]; }

/* --------------------------------------------------------------------- */
/* device-wide accounting                                                 */

static int g_ctlfd = -1; /* $STATE/nvidiactl: what "same" identity exports are descriptions of */
/* "chardev" identity: every export is a write-only description of this
 * character device (TD_CHRDEV) holding an OFD write lock on byte
 * S | i (S = L << 32 | secret with its low TD_CHR_SLOTS bits clear, i a free
 * slot: several exports of one page coexist). fstat gives one inode for
 * every export of every page, read fails (EBADF) and mmap fails (EACCES),
 * as with an fd of the real driver's /dev/nvidiactl. An import reads the
 * lock from /proc/self/fdinfo; the page is on this process's machine. */
#define TD_CHRDEV "/dev/null"
#define TD_CHR_SLOTS 12
static int g_chrfd = -1; /* a read-only description of TD_CHRDEV holding no lock: for F_OFD_GETLK */
static dev_t g_chr_rdev;
static dev_t g_ctl_dev;
static ino_t g_ctl_ino;

/* --------------------------------------------------------------------- */
/* reference tables (KVCACHED_TESTDRV_REFS=table, the default)            */
/*
 * A process's references to pages (its handles and mappings) are not one
 * open description per page: they are one table per process and machine,
 * the file `$STATE/refs/r<pid>-<random>`, which the process holds
 * flock(LOCK_SH) on for as long as it lives (the kernel drops the lock when
 * the process dies, SIGKILL included). The table is an array of slots
 * {key L, device, size}; slot 0-key is free. A process keeps the count of
 * its references to each page in memory and writes the page's slot when the
 * count goes 0 -> 1 and clears it at 1 -> 0. Whoever needs to know whether
 * a page is referenced reads the live tables (a fresh open of a dead
 * process's table takes LOCK_EX|LOCK_NB: the table is removed instead).
 * Exported fds stay open descriptions that pin the page themselves (page
 * directory with LOCK_SH, or nvidiactl with an OFD lock on byte L), and the
 * host view of a page is mapped only for the memset or copy that needs it,
 * so a process holding 100k pages has no fd and no mapping per page.
 * (An OFD byte-range lock per page on one file would need no table, but the
 * kernel keeps one file's locks in a list: with 100k locks a single
 * F_OFD_SETLK or F_OFD_GETLK walks all of them, about 10 ms here.)
 */

struct td_slot { /* one entry of a reference table file */
    uint32_t key;  /* L; 0: free */
    uint32_t phys;
    uint64_t size;
};

struct td_kent { /* 16 bytes: a process may hold 100k of them */
    uint32_t key; /* 0: empty; TD_KEY_TOMB: deleted */
    uint32_t count;
    uint32_t slot;
    uint32_t pages; /* size in 4 KiB units (the device is key >> TD_KEY_DEV_SHIFT) */
};
#define TD_UNIT 4096u
#define TD_KEY_TOMB 0xffffffffu /* keys are < 2^31 (device << 27 | 27 bits) and never 0 */

struct td_kmap { /* open addressing, linear probing */
    struct td_kent *e;
    size_t cap, n, used; /* used: n + tombstones */
};

static size_t kmap_slot(uint32_t key, size_t cap) { return (size_t)(((uint64_t)key * 0x9e3779b97f4a7c15ull) >> 32) & (cap - 1); }

static struct td_kent *kmap_find(struct td_kmap *m, uint32_t key) {
    if (!m->cap) return NULL;
    for (size_t i = kmap_slot(key, m->cap);; i = (i + 1) & (m->cap - 1)) {
        if (m->e[i].key == key) return &m->e[i];
        if (m->e[i].key == 0) return NULL;
    }
}

static bool kmap_rehash(struct td_kmap *m) {
    size_t cap = 64;
    while (cap < (m->n + 1) * 4 / 3) cap *= 2; /* load <= 3/4 after */
    struct td_kent *e = calloc(cap, sizeof *e);
    if (!e) return false;
    for (size_t i = 0; i < m->cap; i++) {
        struct td_kent *o = &m->e[i];
        if (o->key == 0 || o->key == TD_KEY_TOMB) continue;
        size_t j = kmap_slot(o->key, cap);
        while (e[j].key) j = (j + 1) & (cap - 1);
        e[j] = *o;
    }
    free(m->e);
    m->e = e;
    m->cap = cap;
    m->used = m->n;
    return true;
}

/* The entry of `key`, a new zeroed one if absent (NULL: out of memory). */
static struct td_kent *kmap_put(struct td_kmap *m, uint32_t key) {
    struct td_kent *f = kmap_find(m, key);
    if (f) return f;
    if ((m->used + 1) * 10 > m->cap * 9 && !kmap_rehash(m)) return NULL; /* load <= 0.9 */
    size_t i = kmap_slot(key, m->cap);
    while (m->e[i].key && m->e[i].key != TD_KEY_TOMB) i = (i + 1) & (m->cap - 1);
    if (m->e[i].key == 0) m->used++;
    m->e[i] = (struct td_kent){.key = key};
    m->n++;
    return &m->e[i];
}

static void kmap_del(struct td_kmap *m, struct td_kent *e) {
    e->key = TD_KEY_TOMB;
    m->n--;
}

/* A simulated machine (a state directory) this process holds pages of: its
 * own, or another one whose exports it imported. */
#define TD_HINT_BITS 18
#define TD_HINT_BYTES ((size_t)4 << TD_HINT_BITS)

struct td_machine {
    struct td_machine *next;
    dev_t sdev;
    ino_t sino;
    int statefd;
    int ctlfd;  /* a description of nvidiactl holding no lock: for F_OFD_GETLK */
    int refsfd; /* $STATE/refs */
    int devfd[TD_MAX_DEVICES];
    int tabfd; /* this process's table (LOCK_SH), -1 until the first reference */
    ino_t tabino;
    uint32_t *hint; /* refs/.hint, mapped: how many tables may name a key (by hash); NULL: unknown */
    struct td_kmap refs; /* key -> references held here, slot */
    uint32_t *freeslots;
    size_t nfree, capfree;
    uint32_t nslots;
};

static struct td_machine *g_machines, *g_local;

/* Takes `statefd` over. */
static struct td_machine *machine_new(int statefd) {
    struct stat st;
    struct td_machine *m = calloc(1, sizeof *m);
    if (!m || fstat(statefd, &st) != 0) {
        free(m);
        close(statefd);
        return NULL;
    }
    m->sdev = st.st_dev;
    m->sino = st.st_ino;
    m->statefd = statefd;
    m->tabfd = -1;
    for (int i = 0; i < TD_MAX_DEVICES; i++) m->devfd[i] = -1;
    m->ctlfd = openat(statefd, TD_CTL, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    mode_t old = umask(0);
    mkdirat(statefd, "refs", 0777);
    umask(old);
    m->refsfd = openat(statefd, "refs", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (m->refsfd < 0) {
        td_warn("cannot open the reference tables' directory: %s", strerror(errno));
        if (m->ctlfd >= 0) close(m->ctlfd);
        close(statefd);
        free(m);
        return NULL;
    }
    /* The hint: one counter per hash bucket of keys, raised before a table
     * names a key and lowered after it stops. Zero means no live table
     * names any key of the bucket, so dropping a last reference need not
     * read the tables; a process killed with references leaves its counts
     * up (the tables are read then, which is always right). */
    int hfd = openat(m->refsfd, ".hint", O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    struct stat hs;
    if (hfd >= 0) {
        fchmod(hfd, 0666);
        if (fstat(hfd, &hs) == 0 && (hs.st_size == (off_t)TD_HINT_BYTES || ftruncate(hfd, TD_HINT_BYTES) == 0)) {
            void *p = mmap(NULL, TD_HINT_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, hfd, 0);
            if (p != MAP_FAILED) m->hint = p;
        }
        close(hfd);
    }
    m->next = g_machines;
    g_machines = m;
    return m;
}

static uint32_t *hint_of(struct td_machine *m, uint32_t key) {
    return m->hint ? &m->hint[((uint64_t)key * 0x9e3779b97f4a7c15ull) >> (64 - TD_HINT_BITS)] : NULL;
}

static void hint_add(struct td_machine *m, uint32_t key, int delta) {
    uint32_t *h = hint_of(m, key);
    if (h) __atomic_fetch_add(h, (uint32_t)delta, __ATOMIC_SEQ_CST);
}

/* The machine of a page directory (found from it alone: `../..`). */
static struct td_machine *machine_of_page(int pagefd) {
    int sfd = openat(pagefd, "../..", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    struct stat st;
    if (sfd < 0) return NULL;
    if (fstat(sfd, &st) != 0) {
        close(sfd);
        return NULL;
    }
    for (struct td_machine *m = g_machines; m; m = m->next)
        if (m->sdev == st.st_dev && m->sino == st.st_ino) {
            close(sfd);
            return m;
        }
    return machine_new(sfd);
}

static int dev_dirfd(int phys);

static int machine_devfd(struct td_machine *m, int phys) {
    if (m == g_local) return dev_dirfd(phys);
    if (m->devfd[phys] < 0) {
        char name[16];
        snprintf(name, sizeof name, "dev%d", phys);
        m->devfd[phys] = openat(m->statefd, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    }
    return m->devfd[phys];
}

/* A new table file, LOCK_SH held, holding `m`'s current slots, linked into
 * refs/ only once complete (O_TMPFILE; a rename where that is missing). */
static int table_create(struct td_machine *m) {
    char name[64], tmp[64];
    uint32_t tag = (uint32_t)td_random();
    snprintf(name, sizeof name, "r%d-%08x", (int)getpid(), tag);
    snprintf(tmp, sizeof tmp, ".t%d-%08x", (int)getpid(), tag);
    bool tmpfile = true;
    int fd = openat(m->refsfd, ".", O_TMPFILE | O_RDWR | O_CLOEXEC, 0644);
    if (fd < 0) {
        tmpfile = false;
        fd = openat(m->refsfd, tmp, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    }
    if (fd < 0) return -1;
    bool ok = fchmod(fd, 0644) == 0 && flock(fd, LOCK_SH) == 0;
    for (size_t i = 0; ok && i < m->refs.cap; i++) {
        struct td_kent *e = &m->refs.e[i];
        if (e->key == 0 || e->key == TD_KEY_TOMB) continue;
        struct td_slot sl = {e->key, e->key >> TD_KEY_DEV_SHIFT, (uint64_t)e->pages * TD_UNIT};
        ok = pwrite(fd, &sl, sizeof sl, (off_t)e->slot * (off_t)sizeof sl) == (ssize_t)sizeof sl;
    }
    if (ok && tmpfile) {
        char link[64];
        snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
        ok = linkat(AT_FDCWD, link, m->refsfd, name, AT_SYMLINK_FOLLOW) == 0;
    } else if (ok) {
        ok = renameat(m->refsfd, tmp, m->refsfd, name) == 0;
    }
    struct stat st;
    if (ok && fstat(fd, &st) == 0) m->tabino = st.st_ino;
    if (!ok) {
        int e = errno;
        if (!tmpfile) unlinkat(m->refsfd, tmp, 0);
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

/* One more reference of this process to page `key` of machine `m`. */
static CUresult ref_take(struct td_machine *m, uint32_t key, int phys, size_t size) {
    struct td_kent *e = kmap_find(&m->refs, key);
    if (e) {
        e->count++;
        return CUDA_SUCCESS;
    }
    if (m->tabfd < 0 && (m->tabfd = table_create(m)) < 0) {
        td_warn("cannot create a reference table: %s", strerror(errno));
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    if (m->capfree < (size_t)m->nslots + 1) { /* room for every slot: ref_drop always has a place */
        size_t cap = m->capfree ? m->capfree * 2 : 256;
        uint32_t *n = realloc(m->freeslots, cap * sizeof *n);
        if (!n) return CUDA_ERROR_OUT_OF_MEMORY;
        m->freeslots = n;
        m->capfree = cap;
    }
    uint32_t slot = m->nfree ? m->freeslots[--m->nfree] : m->nslots++;
    struct td_slot sl = {key, (uint32_t)phys, size};
    e = kmap_put(&m->refs, key);
    hint_add(m, key, 1); /* before the slot names it */
    if (!e || pwrite(m->tabfd, &sl, sizeof sl, (off_t)slot * (off_t)sizeof sl) != (ssize_t)sizeof sl) {
        hint_add(m, key, -1);
        if (e) kmap_del(&m->refs, e);
        m->freeslots[m->nfree++] = slot;
        return e ? CUDA_ERROR_OPERATING_SYSTEM : CUDA_ERROR_OUT_OF_MEMORY;
    }
    *e = (struct td_kent){key, 1, slot, (uint32_t)(size / TD_UNIT)};
    return CUDA_SUCCESS;
}

static void ref_drop(struct td_machine *m, uint32_t key) {
    struct td_kent *e = kmap_find(&m->refs, key);
    if (!e || --e->count > 0) return;
    struct td_slot sl = {0, 0, 0};
    if (pwrite(m->tabfd, &sl, sizeof sl, (off_t)e->slot * (off_t)sizeof sl) != (ssize_t)sizeof sl)
        td_warn("cannot update the reference table: %s", strerror(errno));
    else hint_add(m, key, -1); /* after the slot stopped naming it */
    if (m->nfree < m->capfree) m->freeslots[m->nfree++] = e->slot; /* capfree >= nslots always */
    kmap_del(&m->refs, e);
}

/* Read every live table of a machine (`refsfd`: its refs/; removing dead processes' tables):
 * with `want` != 0, stop and return true at the first slot of that key;
 * else add every referenced page to `out` (key, device, size). */
struct td_slots { /* slots read from tables, sorted by key for lookups */
    struct td_slot *v;
    size_t n, cap;
};

static bool slots_add(struct td_slots *s, struct td_slot sl) {
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 1024;
        struct td_slot *v = realloc(s->v, cap * sizeof *v);
        if (!v) return false;
        s->v = v;
        s->cap = cap;
    }
    s->v[s->n++] = sl;
    return true;
}

static int slot_cmp(const void *a, const void *b) {
    uint32_t x = ((const struct td_slot *)a)->key, y = ((const struct td_slot *)b)->key;
    return x < y ? -1 : x > y;
}

static bool tables_read(int refsfd, uint32_t want, struct td_slots *out, ino_t skip) {
    int dfd = openat(refsfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC); /* a description of its own */
    if (dfd < 0) return false;
    DIR *d = fdopendir(dfd);
    if (!d) {
        close(dfd);
        return false;
    }
    bool found = false;
    static struct td_slot buf[4096];
    struct dirent *de;
    while (!found && (de = readdir(d))) {
        if (de->d_name[0] != 'r') continue;
        if (skip && de->d_ino == skip) continue; /* the caller's own: known from memory */
        int fd = openat(dfd, de->d_name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
        if (fd < 0) continue;
        if (flock(fd, LOCK_EX | LOCK_NB) == 0) { /* its process is gone */
            unlinkat(dfd, de->d_name, 0);
            close(fd);
            continue;
        }
        off_t off = 0;
        ssize_t n;
        while (!found && (n = pread(fd, buf, sizeof buf, off)) > 0) {
            for (size_t i = 0; i < (size_t)n / sizeof buf[0]; i++) {
                struct td_slot *sl = &buf[i];
                if (!sl->key || sl->key == TD_KEY_TOMB) continue;
                if (want) {
                    if (sl->key == want) found = true;
                } else {
                    slots_add(out, *sl);
                }
            }
            off += n;
        }
        close(fd);
    }
    closedir(d);
    return found;
}

/* Is page `key` of `m` referenced by a handle or mapping of any process? */
static bool table_referenced(struct td_machine *m, uint32_t key) {
    struct td_kent *e = kmap_find(&m->refs, key);
    if (e && e->count > 0) return true;
    uint32_t *h = hint_of(m, key);
    if (h && __atomic_load_n(h, __ATOMIC_SEQ_CST) == 0) return false; /* no live table names it */
    return tables_read(m->refsfd, key, NULL, m->tabfd >= 0 ? m->tabino : 0);
}

/* After fork() in the parent: the child keeps the table it inherited (its
 * references are those of the parent at fork time, until it execs or
 * exits, as inherited device-node fds would keep them); the parent goes on
 * with a copy of its own. */
static void tables_after_fork(void) {
    for (struct td_machine *m = g_machines; m; m = m->next) {
        if (m->tabfd < 0) continue;
        int fd = table_create(m);
        if (fd < 0) {
            td_warn("cannot copy the reference table after fork(): %s", strerror(errno));
            continue;
        }
        close(m->tabfd);
        m->tabfd = fd;
        for (size_t i = 0; i < m->refs.cap; i++) /* the copy names them too */
            if (m->refs.e[i].key && m->refs.e[i].key != TD_KEY_TOMB) hint_add(m, m->refs.e[i].key, 1);
    }
}

/* Does some description hold the OFD lock of page `key` on nvidiactl (an
 * export in "same" identity mode is alive)? `ctl`: that machine's nvidiactl. */
static bool ctl_locked(int ctl, uint32_t key) {
    if (ctl < 0) return false;
    struct flock q = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = (off_t)key, .l_len = 1};
    return fcntl(ctl, F_OFD_GETLK, &q) == 0 && q.l_type != F_UNLCK;
}

/* Does a "chardev" export of page `key` live (a lock in its range)? */
static bool chr_locked(uint32_t key) {
    if (g_chrfd < 0) return false;
    struct flock q = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = (off_t)((uint64_t)key << 32),
                      .l_len = (off_t)1 << 32};
    return fcntl(g_chrfd, F_OFD_GETLK, &q) == 0 && q.l_type != F_UNLCK;
}

/* Page directory `fd` (LOCK_EX held): still referenced by an export that
 * holds no flock on it? */
static bool held_by_export(int fd, uint32_t key, int ctl) {
    if (ctl_locked(ctl, key)) return true;
    if (cfg.fdmode == FD_CHR && chr_locked(key)) return true;
    if (cfg.fdmode == FD_FILE) { /* lenient exports are descriptions of the data file */
        int dfd = openat(fd, "data", O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
        if (dfd >= 0) {
            bool busy = flock(dfd, LOCK_EX | LOCK_NB) != 0;
            close(dfd);
            return busy;
        }
    }
    return false;
}

static void remove_page_dir(int dfd, const char *name, int fd) {
    unlinkat(fd, "data", 0);
    unlinkat(dfd, name, AT_REMOVEDIR);
}

/* Bytes in use on physical device `phys` by pages and contexts of every
 * process; garbage (nothing references it) is removed on the way. */
static size_t scan_used(int phys) {
    int dfd0 = dev_dirfd(phys);
    if (dfd0 < 0) return 0;
    int dfd = openat(dfd0, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC); /* a description of its own */
    if (dfd < 0) return 0;
    DIR *d = fdopendir(dfd);
    if (!d) {
        close(dfd);
        return 0;
    }
    size_t used = 0;
    /* the pages some process's reference table names (REFS=table): in use,
     * and their size is in the table (no need to open them) */
    struct td_slots live = {0};
    if (g_local) {
        struct td_machine *m = g_local;
        tables_read(m->refsfd, 0, &live, m->tabfd >= 0 ? m->tabino : 0);
        for (size_t i = 0; i < m->refs.cap; i++) { /* this process's own, from memory */
            struct td_kent *o = &m->refs.e[i];
            if (!o->key || o->key == TD_KEY_TOMB) continue;
            slots_add(&live, (struct td_slot){o->key, o->key >> TD_KEY_DEV_SHIFT, (uint64_t)o->pages * TD_UNIT});
        }
        if (live.n) qsort(live.v, live.n, sizeof live.v[0], slot_cmp);
    }
    struct dirent *e;
    while ((e = readdir(d))) {
        const char *n = e->d_name;
        if (n[0] != 'p' && n[0] != 'c') continue;
        char *end;
        unsigned long key = strtoul(n + 1, &end, 16);
        size_t ctx_size = 0;
        if (n[0] == 'c') {
            if (*end != '.') continue;
            ctx_size = (size_t)strtoull(end + 1, &end, 16);
        }
        if (*end) continue;
        if (n[0] == 'p') {
            struct td_slot probe = {(uint32_t)key, 0, 0};
            struct td_slot *k = live.n ? bsearch(&probe, live.v, live.n, sizeof live.v[0], slot_cmp) : NULL;
            if (k) {
                used += k->size;
                continue;
            }
        }
        int fd = openat(dfd, n, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
        if (fd < 0) continue;
        bool busy = flock(fd, LOCK_EX | LOCK_NB) != 0;
        if (n[0] == 'c') {
            if (busy) used += ctx_size;
            else unlinkat(dfd, n, AT_REMOVEDIR);
        } else if (busy || held_by_export(fd, (uint32_t)key, g_ctlfd)) {
            struct stat st;
            if (fstatat(fd, "data", &st, AT_SYMLINK_NOFOLLOW) == 0 && st.st_size >= (off_t)TD_TRAILER)
                used += (size_t)st.st_size - TD_TRAILER;
        } else {
            remove_page_dir(dfd, n, fd);
        }
        close(fd);
    }
    closedir(d);
    free(live.v);
    return used;
}

static bool g_lock_ro[TD_MAX_DEVICES]; /* another uid's lock file: no bound kept here */

static int device_lock(int phys) {
    if (g_lockfd[phys] < 0) {
        char path[PATH_MAX];
        snprintf(path, sizeof path, "%s/dev%d/.lock", cfg.state, phys);
        g_lockfd[phys] = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
        if (g_lockfd[phys] >= 0) {
            fchmod(g_lockfd[phys], 0666); /* whatever the creator's umask; fails harmlessly if not ours */
        } else if (errno == EACCES) {
            g_lockfd[phys] = open(path, O_RDONLY | O_CLOEXEC); /* flock needs no write access */
            g_lock_ro[phys] = g_lockfd[phys] >= 0;
        }
        if (g_lockfd[phys] < 0) return -1;
    }
    while (flock(g_lockfd[phys], LOCK_EX) != 0)
        if (errno != EINTR) return -1;
    return g_lockfd[phys];
}

static void device_unlock(int phys) { flock(g_lockfd[phys], LOCK_UN); }

/* Under the device lock: room for `size` more bytes? The lock file holds an
 * upper bound of the device's used bytes; only when it says "full" is the
 * directory scanned for the exact number. On success the bound grows. */
static bool device_reserve(int phys, int lfd, size_t size) {
    uint64_t bound = 0;
    size_t cap = capacity(phys);
    if (g_lock_ro[phys] || pread(lfd, &bound, sizeof bound, 0) != (ssize_t)sizeof bound) bound = cap;
    if (bound + size > cap) bound = scan_used(phys);
    bool ok = bound + size <= cap;
    if (ok) bound += size;
    if (!g_lock_ro[phys] && pwrite(lfd, &bound, sizeof bound, 0) != (ssize_t)sizeof bound) td_warn("cannot update the device bound");
    return ok;
}

/* Remove page `key` (a child of `dfd`, a device directory of machine `m`,
 * whichever the page belongs to) if nothing references it any more: no
 * description pins it (REFS=fds references, exports) and no process's
 * reference table names it. */
static void try_collect(struct td_machine *m, int dfd, uint32_t key, ino_t sino) {
    char name[16];
    page_name(key, name);
    int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return;
    struct stat st;
    if (fstat(fd, &st) == 0 && st.st_ino == sino && flock(fd, LOCK_EX | LOCK_NB) == 0) {
        int ctl = openat(dfd, "../" TD_CTL, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        bool referenced = false;
        if (m) {
            referenced = table_referenced(m, key);
        } else { /* a REFS=fds process: other processes may keep tables */
            int rf = openat(dfd, "../refs", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
            if (rf >= 0) {
                referenced = tables_read(rf, key, NULL, 0);
                close(rf);
            }
        }
        if (!held_by_export(fd, key, ctl) && !referenced) remove_page_dir(dfd, name, fd);
        if (ctl >= 0) close(ctl);
    }
    close(fd);
}

/* --------------------------------------------------------------------- */
/* pages                                                                  */

static volatile uint8_t *bitmap_of(struct td_alloc *a, unsigned char *host) {
    return (volatile uint8_t *)(host + a->size + TD_HDR);
}

static bool poisoned(struct td_alloc *a, unsigned char *host, size_t blk) {
    return (__atomic_load_n(&bitmap_of(a, host)[blk / 8], __ATOMIC_ACQUIRE) >> (blk % 8)) & 1;
}

static void unpoison(struct td_alloc *a, unsigned char *host, size_t blk) {
    __atomic_fetch_and(&bitmap_of(a, host)[blk / 8], (uint8_t) ~(1u << (blk % 8)), __ATOMIC_RELEASE);
}

static size_t block_for(size_t size) {
    size_t nmax = (size_t)TD_BITMAP * 8;
    size_t b = TD_BLOCK;
    if (size / b > nmax) b = ((size + nmax - 1) / nmax + TD_BLOCK - 1) / TD_BLOCK * TD_BLOCK;
    return b;
}

/* Map the page's data file (`dirfd`: the page directory) and check its size. */
static unsigned char *map_data(int dirfd, size_t size) {
    int fd = openat(dirfd, "data", O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return NULL;
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size < (off_t)(TD_TRAILER + cfg.gran) ||
        (size_t)st.st_size - TD_TRAILER != size) {
        close(fd);
        return NULL;
    }
    void *p = mmap(NULL, size + TD_TRAILER, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return NULL;
    if (cfg.fork_refuse) madvise(p, size + TD_TRAILER, MADV_DONTFORK); /* a forked child has no device memory */
    return p;
}

/* REFS=fds: the permanent host view of the page. */
static CUresult alloc_map(struct td_alloc *a) {
    a->host = map_data(a->dirfd, a->size);
    return a->host ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* The host view of the page's bytes and trailer for one memset or copy:
 * REFS=fds keeps one per page; REFS=table maps it for the operation only
 * (view_close). NULL if the page's file cannot be mapped. */
static unsigned char *view_open(struct td_alloc *a) {
    if (a->host) return a->host;
    char name[16];
    page_name(a->key, name);
    int dfd = machine_devfd(a->m, a->phys);
    int pfd = dfd < 0 ? -1 : openat(dfd, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
    if (pfd < 0) return NULL;
    unsigned char *p = map_data(pfd, a->size);
    close(pfd);
    return p;
}

static void view_close(struct td_alloc *a, unsigned char *v) {
    if (v && v != a->host) munmap(v, a->size + TD_TRAILER);
}

static void alloc_free(struct td_alloc *a) {
    if (a->host) munmap(a->host, a->size + TD_TRAILER);
    if (a->dirfd >= 0) close(a->dirfd);
    if (cfg.refs == REFS_TABLE && a->m && a->refd) ref_drop(a->m, a->key);
    free(a);
}

static void alloc_unref(struct td_alloc *a) {
    if (--a->refs > 0) return;
    uint32_t key = a->key;
    ino_t sino = a->st_ino;
    struct td_machine *m = a->m;
    int parent; /* the page's device directory */
    if (a->dirfd >= 0) parent = openat(a->dirfd, "..", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    else parent = fcntl(machine_devfd(m, a->phys), F_DUPFD_CLOEXEC, 0);
    alloc_free(a);
    if (parent >= 0) {
        try_collect(m, parent, key, sino);
        close(parent);
    }
}

/* Write page `a`'s trailer and poison (a new page: nobody else sees it yet). */
static CUresult page_init(struct td_alloc *a, int pagefd) {
    int datafd = openat(pagefd, "data", O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (datafd < 0 || fchmod(datafd, 0666) != 0 || ftruncate(datafd, (off_t)(a->size + TD_TRAILER)) != 0) {
        CUresult r = errno == ENOSPC || errno == EFBIG || errno == ENOMEM ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_OPERATING_SYSTEM;
        if (datafd >= 0) close(datafd);
        return r;
    }
    struct td_trailer t;
    memset(&t, 0, sizeof t);
    memcpy(t.magic, TD_MAGIC, 8);
    t.phys = (uint32_t)a->phys;
    t.version = 2;
    t.size = a->size;
    t.key = a->key;
    t.block = block_for(a->size);
    t.secret_hash = td_hash(a->secret);
    memcpy(t.uuid, cfg.uuid[a->phys], 16);
    /* Fresh device memory is not zero on a real GPU: every block reads 0xdb
     * until written (kept as a bitmap, so it costs no host memory). */
    size_t block = block_for(a->size), nblocks = (a->size + block - 1) / block;
    static uint8_t bm[TD_BITMAP];
    size_t bmlen = (nblocks + 7) / 8;
    memset(bm, 0, bmlen);
    if (cfg.poison == POISON_FULL) {
        memset(bm, 0xff, nblocks / 8);
        if (nblocks % 8) bm[nblocks / 8] = (uint8_t)((1u << (nblocks % 8)) - 1);
    } else if (cfg.poison == POISON_EDGES) { /* the driver before issue 17: first and last block only */
        bm[0] |= 1;
        bm[(nblocks - 1) / 8] |= (uint8_t)(1u << ((nblocks - 1) % 8));
    }
    bool ok = pwrite(datafd, &t, sizeof t, (off_t)a->size) == (ssize_t)sizeof t &&
              (cfg.poison == POISON_OFF || pwrite(datafd, bm, bmlen, (off_t)(a->size + TD_HDR)) == (ssize_t)bmlen);
    close(datafd);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

/* Create one page on `phys` (caller holds the device lock and reserved the bytes). */
static CUresult create_page(int phys, size_t size, struct td_alloc **out) {
    int dfd = dev_dirfd(phys);
    if (dfd < 0) return CUDA_ERROR_OPERATING_SYSTEM;
    struct td_alloc *a = calloc(1, sizeof *a);
    if (!a) return CUDA_ERROR_OUT_OF_MEMORY;
    a->m = g_local;
    a->dirfd = -1;
    a->phys = phys;
    a->size = size;
    char name[16];
    for (int attempt = 0;; attempt++) {
        a->key = ((uint32_t)phys << TD_KEY_DEV_SHIFT) | (uint32_t)(td_random() & ((1u << TD_KEY_DEV_SHIFT) - 1));
        page_name(a->key, name);
        if (a->key && mkdirat(dfd, name, 0777) == 0) break;
        if ((a->key && errno != EEXIST) || attempt > 1000) {
            td_warn("mkdir %s/dev%d/%s: %s", cfg.state, phys, name, strerror(errno));
            free(a);
            return errno == ENOSPC ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_OPERATING_SYSTEM;
        }
    }
    CUresult r = CUDA_ERROR_OPERATING_SYSTEM;
    int pfd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
    if (pfd < 0) goto fail;
    /* the reference first: from now on the page is in use */
    if (cfg.refs == REFS_FDS) {
        if (flock(pfd, LOCK_SH) != 0) goto fail;
    } else {
        r = ref_take(a->m, a->key, phys, size);
        if (r) goto fail;
        a->refd = true;
        r = CUDA_ERROR_OPERATING_SYSTEM;
    }
    /* whatever the creator's umask: another uid's process imports the page
     * (opens data read-write) and may collect it (unlinks data) */
    if (fchmod(pfd, 0777) != 0) goto fail;
    a->secret = ((uint64_t)a->key << 32) | (uint32_t)(td_random() | 1);
    if (cfg.fdmode == FD_CHR) /* the low bits number the exports (TD_CHRDEV) */
        a->secret = (a->secret & ~(((uint64_t)1 << TD_CHR_SLOTS) - 1)) | ((uint64_t)1 << TD_CHR_SLOTS);
    if (lseek(pfd, (off_t)a->secret, SEEK_SET) != (off_t)a->secret) goto fail;
    struct stat st;
    if (fstat(pfd, &st) != 0) goto fail;
    a->st_ino = st.st_ino;
    r = page_init(a, pfd);
    if (r) goto fail;
    if (cfg.refs == REFS_FDS) {
        a->dirfd = pfd;
        pfd = -1;
        r = alloc_map(a);
        if (r) goto fail;
    } else {
        close(pfd);
        pfd = -1;
    }
    a->refs = 1;
    *out = a;
    return CUDA_SUCCESS;
fail:
    if (pfd >= 0) {
        unlinkat(pfd, "data", 0);
        close(pfd);
    }
    if (a->dirfd >= 0) unlinkat(a->dirfd, "data", 0);
    unlinkat(dfd, name, AT_REMOVEDIR);
    alloc_free(a);
    return r;
}

/* An import's own reference to a page: `dirfd` is a fresh description of
 * the page directory (taken over). REFS=fds: LOCK_SH on it, offset S, the
 * host view; REFS=table: a reference in this process's table of the
 * page's machine, and the description is closed. */
static CUresult open_page(int dirfd, int phys, uint32_t key, uint64_t secret, struct td_alloc **out) {
    struct td_alloc *a = calloc(1, sizeof *a);
    if (!a) {
        close(dirfd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    a->phys = phys;
    a->key = key;
    a->secret = secret;
    a->dirfd = dirfd;
    struct stat st;
    struct td_trailer t;
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    if (cfg.refs == REFS_FDS && flock(a->dirfd, LOCK_SH) != 0) goto fail;
    if (fstat(a->dirfd, &st) != 0) goto fail;
    a->st_ino = st.st_ino;
    if (secret && lseek(a->dirfd, (off_t)secret, SEEK_SET) != (off_t)secret) goto fail;
    int fd = openat(a->dirfd, "data", O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) goto fail;
    bool ok = fstat(fd, &st) == 0 && st.st_size >= (off_t)(TD_TRAILER + cfg.gran) &&
              pread(fd, &t, sizeof t, st.st_size - (off_t)TD_TRAILER) == (ssize_t)sizeof t;
    close(fd);
    if (!ok || memcmp(t.magic, TD_MAGIC, 8) != 0 || t.key != key || t.phys != (uint32_t)phys ||
        t.size != (uint64_t)st.st_size - TD_TRAILER)
        goto fail;
    if (secret && td_hash(secret) != t.secret_hash) goto fail; /* not an export of this page */
    a->size = (size_t)t.size;
    if (t.block != block_for(a->size)) goto fail;
    a->m = machine_of_page(a->dirfd);
    if (!a->m) {
        r = CUDA_ERROR_OPERATING_SYSTEM;
        goto fail;
    }
    if (cfg.refs == REFS_FDS) {
        r = alloc_map(a);
        if (r) goto fail;
    } else {
        /* the caller still holds the export, which pins the page until
         * the table says it is referenced */
        r = ref_take(a->m, key, phys, a->size);
        if (r) goto fail;
        a->refd = true;
        close(a->dirfd);
        a->dirfd = -1;
    }
    a->refs = 1;
    *out = a;
    return CUDA_SUCCESS;
fail:
    alloc_free(a);
    return r;
}

static CUresult handle_new(struct td_alloc *a, bool imported, CUmemGenericAllocationHandle *out) {
    if (g_nhandles == g_caphandles) {
        size_t cap = g_caphandles ? g_caphandles * 2 : 256;
        struct td_handle *n = realloc(g_handles, cap * sizeof *n);
        if (!n) return CUDA_ERROR_OUT_OF_MEMORY;
        g_handles = n;
        g_caphandles = cap;
    }
    a->imported = imported;
    g_handles[g_nhandles] = (struct td_handle){a};
    *out = TD_HANDLE_BASE + g_nhandles + 1;
    g_nhandles++;
    g_livehandles++;
    return CUDA_SUCCESS;
}

static struct td_handle *handle_get(CUmemGenericAllocationHandle h) {
    if (h <= TD_HANDLE_BASE || h > TD_HANDLE_BASE + g_nhandles) return NULL;
    struct td_handle *e = &g_handles[h - TD_HANDLE_BASE - 1];
    return e->alloc ? e : NULL;
}

/* --------------------------------------------------------------------- */
/* reservations and mappings                                              */

static struct td_resv *resv_find(uintptr_t addr, size_t size) {
    for (size_t i = 0; i < g_nresv; i++) {
        struct td_resv *r = g_resv[i];
        if (addr >= r->base && addr - r->base < r->size && size <= r->size - (addr - r->base)) return r;
    }
    return NULL;
}

static struct td_map *slot_at(struct td_resv *r, uintptr_t addr) { return r->slots[(addr - r->base) / cfg.gran]; }

/* The mappings that exactly tile [addr, addr+size): each starts where the
 * previous ended, the first at addr, the last ends at addr+size. */
static bool whole_mappings(struct td_resv *r, uintptr_t addr, size_t size) {
    uintptr_t cur = addr, end = addr + size;
    if ((addr - r->base) % cfg.gran) return false;
    while (cur < end) {
        struct td_map *m = slot_at(r, cur);
        if (!m || m->va != cur || m->size > end - cur) return false;
        cur += m->size;
    }
    return cur == end && size > 0;
}

/* No mapping in [addr, addr+size) of r (granularity-aligned)? */
static bool nothing_mapped(struct td_resv *r, uintptr_t addr, size_t size) {
    for (uintptr_t cur = addr, end = addr + size; cur < end; cur += cfg.gran)
        if (slot_at(r, cur)) return false;
    return true;
}

/* [addr, addr+n) wholly mapped (no access check)? */
static struct td_resv *range_mapped(uintptr_t addr, size_t n) {
    struct td_resv *r = resv_find(addr, n);
    if (!r) return NULL;
    for (uintptr_t cur = addr, end = addr + n; cur < end;) {
        struct td_map *m = slot_at(r, cur);
        if (!m) return NULL;
        cur = m->va + m->size;
    }
    return r;
}

/* Check that [addr, addr+n) is mapped and accessible with `need` from the
 * current context's device; on success the copy loop may run. */
static CUresult range_check(uintptr_t addr, size_t n, unsigned need, struct CUctx_st *ctx, struct td_resv **out) {
    struct td_resv *r = resv_find(addr, n);
    if (!r) return CUDA_ERROR_INVALID_VALUE;
    uintptr_t cur = addr, end = addr + n;
    while (cur < end) {
        struct td_map *m = slot_at(r, cur);
        if (!m) return CUDA_ERROR_INVALID_VALUE;
        if ((m->access[ctx->phys] & need) != need) return CUDA_ERROR_INVALID_VALUE;
        cur = m->va + m->size;
    }
    *out = r;
    return CUDA_SUCCESS;
}

/* Bytes [off, off+len) of one page: read, write or set, honouring the
 * poison bitmap (a block still poisoned reads 0xdb; a partial write first
 * gives it its 0xdb bytes for real). */
static void page_do(struct td_alloc *a, size_t off, size_t len, enum td_opkind op, unsigned char *buf, unsigned char val) {
    unsigned char *view = view_open(a);
    if (!view) { /* the page's file is gone or cannot be mapped: nothing lands (reads give poison) */
        td_warn("cannot map page p%08x: %s", a->key, strerror(errno));
        if (op == OP_READ) memset(buf, TD_POISON_BYTE, len);
        g_lost_ops++;
        return;
    }
    size_t end = off + len, block = block_for(a->size);
    for (size_t cur = off; cur < end;) {
        size_t blk = cur / block;
        size_t b0 = blk * block, b1 = b0 + block;
        if (b1 > a->size) b1 = a->size;
        size_t stop = end < b1 ? end : b1;
        size_t n = stop - cur;
        bool pois = poisoned(a, view, blk);
        unsigned char *host = view + cur;
        if (op == OP_READ) {
            if (pois) memset(buf, TD_POISON_BYTE, n);
            else memcpy(buf, host, n);
        } else {
            bool whole = cur == b0 && stop == b1;
            if (pois && !whole) memset(view + b0, TD_POISON_BYTE, b1 - b0);
            if (op == OP_WRITE) memcpy(host, buf, n);
            else if (val != 0 || n < (size_t)g_pagesize) memset(host, val, n);
            else {
                /* zeros: punch the whole host pages (frees the tmpfs memory,
                 * every view reads zeros), memset the edges */
                size_t p0 = (cur + (size_t)g_pagesize - 1) / (size_t)g_pagesize * (size_t)g_pagesize;
                size_t p1 = stop / (size_t)g_pagesize * (size_t)g_pagesize;
                if (p1 > p0 && madvise(view + p0, p1 - p0, MADV_REMOVE) == 0) {
                    memset(host, 0, p0 - cur);
                    memset(view + p1, 0, stop - p1);
                } else {
                    memset(host, 0, n);
                }
            }
            if (pois) unpoison(a, view, blk);
        }
        if (buf) buf += n;
        cur = stop;
    }
    view_close(a, view);
}

static void range_do(struct td_resv *r, uintptr_t addr, size_t n, enum td_opkind op, unsigned char *buf, unsigned char val) {
    uintptr_t cur = addr, end = addr + n;
    while (cur < end) {
        struct td_map *m = slot_at(r, cur);
        size_t off = cur - m->va;
        size_t len = m->va + m->size - cur;
        if (len > end - cur) len = end - cur;
        page_do(m->alloc, off, len, op, buf, val);
        if (buf) buf += len;
        cur += len;
    }
}

/* --------------------------------------------------------------------- */
/* work issued on a context's stream                                      */

static CUresult queue_push(struct td_queue *q, struct td_op op) {
    if (q->nops == q->capops) {
        size_t cap = q->capops ? q->capops * 2 : 16;
        struct td_op *n = realloc(q->ops, cap * sizeof *n);
        if (!n) return CUDA_ERROR_OUT_OF_MEMORY;
        q->ops = n;
        q->capops = cap;
    }
    q->ops[q->nops++] = op;
    return CUDA_SUCCESS;
}

static CUresult op_push(struct CUctx_st *c, struct td_op op) { return queue_push(&c->q, op); }

/* Let the first `upto` operations of a queue land, in order (the rest stay
 * queued). Work whose range is no longer mapped is lost (it was purged at
 * cuMemUnmap already). */
static void queue_land(struct td_queue *q, size_t upto) {
    if (upto > q->nops) upto = q->nops;
    for (size_t i = 0; i < upto; i++) {
        struct td_op *op = &q->ops[i];
        struct td_resv *r = range_mapped(op->va, op->n);
        if (r) range_do(r, op->va, op->n, op->kind, op->data, op->val);
        else g_lost_ops++;
        free(op->data);
    }
    memmove(q->ops, q->ops + upto, (q->nops - upto) * sizeof *q->ops);
    q->nops -= upto;
}

static void queue_drop(struct td_queue *q) {
    for (size_t i = 0; i < q->nops; i++) free(q->ops[i].data);
    g_lost_ops += q->nops;
    q->nops = 0;
}

static void queue_purge(struct td_queue *q, uintptr_t va, size_t n) {
    size_t w = 0;
    for (size_t i = 0; i < q->nops; i++) {
        struct td_op *op = &q->ops[i];
        if (op->va < va + n && va < op->va + op->n) {
            free(op->data);
            g_lost_ops++;
        } else {
            q->ops[w++] = *op;
        }
    }
    q->nops = w;
}

/* Streams (cuStreamCreate) and events (cuEventCreate). Each stream has a
 * queue of its own; an event remembers how much of its stream's queue was
 * issued when it was recorded. Work lands when something waits for it
 * (cuEventSynchronize, cuStreamSynchronize, cuCtxSynchronize, a synchronous
 * copy for the blocking streams), or, for cuEventQuery, once a query has
 * seen it pending: the first query of pending work answers
 * CUDA_ERROR_NOT_READY and lets it land, so pollers see both answers. */
#define TD_STREAM_MAGIC 0x6b767374u
#define TD_EVENT_MAGIC 0x6b766576u
struct CUstream_st {
    uint32_t magic;
    struct CUctx_st *ctx;
    unsigned flags;
    struct td_queue q;
    uint64_t issued; /* operations ever issued on it */
    uint64_t landed; /* of those, landed or dropped */
    struct CUstream_st *next;
};
struct CUevent_st {
    uint32_t magic;
    unsigned flags;
    struct CUstream_st *stream; /* where it was last recorded; NULL: the context's own stream */
    struct CUctx_st *ctx;
    uint64_t mark;              /* stream->issued at the record */
    struct CUevent_st *next;
};
static struct CUstream_st *g_streams;
static struct CUevent_st *g_events;
static size_t g_nstreams, g_nevents;

static void stream_land(struct CUstream_st *s, size_t upto) {
    if (upto > s->q.nops) upto = s->q.nops;
    queue_land(&s->q, upto);
    s->landed += upto;
}

/* Let everything issued on the context land, in order: its own stream,
 * then every stream made in it. */
static void ctx_flush(struct CUctx_st *c) {
    queue_land(&c->q, c->q.nops);
    for (struct CUstream_st *s = g_streams; s; s = s->next)
        if (s->ctx == c) stream_land(s, s->q.nops);
}

/* A synchronous copy waits for the context's own stream and the streams
 * that synchronise with it (not CU_STREAM_NON_BLOCKING ones). */
static void ctx_flush_blocking(struct CUctx_st *c) {
    queue_land(&c->q, c->q.nops);
    for (struct CUstream_st *s = g_streams; s; s = s->next)
        if (s->ctx == c && !(s->flags & CU_STREAM_NON_BLOCKING)) stream_land(s, s->q.nops);
}

static void ctx_drop(struct CUctx_st *c) {
    queue_drop(&c->q);
    for (struct CUstream_st *s = g_streams; s; s = s->next)
        if (s->ctx == c) {
            s->landed += s->q.nops;
            queue_drop(&s->q);
        }
}

/* cuMemUnmap of [va, va+n): pending work on it (in any context of this
 * process) never lands. Whether a real driver waits for it first is not
 * documented; here it is lost, so code that unmaps before synchronising
 * loses its memset and the leak report counts it. */
static void ops_purge(uintptr_t va, size_t n) {
    for (int o = 0; o < cfg.nvis; o++) queue_purge(&g_ctx[o].q, va, n);
    for (struct CUstream_st *s = g_streams; s; s = s->next) {
        size_t before = s->q.nops;
        queue_purge(&s->q, va, n);
        s->landed += before - s->q.nops;
    }
}

static size_t ops_pending(void) {
    size_t n = 0;
    for (int o = 0; o < TD_MAX_DEVICES; o++) n += g_ctx[o].q.nops;
    for (struct CUstream_st *s = g_streams; s; s = s->next) n += s->q.nops;
    return n;
}

/* --------------------------------------------------------------------- */
/* exported fds                                                           */

static bool export_still_open(const struct td_export *e) {
    struct stat st;
    if (fstat(e->fd, &st) != 0 || st.st_dev != e->st_dev || st.st_ino != e->st_ino) return false;
    return !e->secret || lseek(e->fd, 0, SEEK_CUR) == (off_t)e->secret;
}

static void exports_prune(void) {
    size_t o = 0;
    for (size_t i = 0; i < g_nexports; i++)
        if (export_still_open(&g_exports[i])) g_exports[o++] = g_exports[i];
    g_nexports = o;
    g_exports_pruned_at = o;
}

/* ===================================================================== */
/* the driver API                                                         */

CUresult CUDAAPI cuGetErrorName(CUresult error, const char **pStr) {
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    const struct td_errname *e = td_err_lookup(error);
    if (!e) {
        *pStr = NULL;
        return CUDA_ERROR_INVALID_VALUE;
    }
    *pStr = e->name;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuGetErrorString(CUresult error, const char **pStr) {
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    const struct td_errname *e = td_err_lookup(error);
    if (!e) {
        *pStr = NULL;
        return CUDA_ERROR_INVALID_VALUE;
    }
    *pStr = e->desc[0] ? e->desc : e->name;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDriverGetVersion(int *driverVersion) {
    LOCK();
    CUresult inj = td_enter(FN_cuDriverGetVersion);
    UNLOCK();
    if (inj) return inj;
    if (!driverVersion) return CUDA_ERROR_INVALID_VALUE;
    *driverVersion = CUDA_VERSION;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuInit(unsigned int Flags) {
    LOCK();
    CUresult inj = td_enter(FN_cuInit);
    if (inj) RETURN(inj);
    if (g_forked) RETURN(CUDA_ERROR_NOT_INITIALIZED); /* the parent's driver state is not ours */
    if (Flags != 0) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (cfg.config_error[0]) {
        td_warn("%s", cfg.config_error);
        RETURN(CUDA_ERROR_INVALID_VALUE);
    }
    if (g_inited) RETURN(CUDA_SUCCESS);
    if (cfg.nphys == 0 || cfg.nvis == 0) RETURN(CUDA_ERROR_NO_DEVICE);
    mode_t old = umask(0);
    char dir[PATH_MAX];
    for (int i = 0; i <= cfg.nphys; i++) {
        if (i < cfg.nphys) devdir(i, dir, sizeof dir);
        else snprintf(dir, sizeof dir, "%s/%s", cfg.state, TD_CTL);
        if (mkdir_p(dir, 0777) != 0) {
            umask(old);
            td_warn("cannot create state directory %s: %s", dir, strerror(errno));
            RETURN(CUDA_ERROR_OPERATING_SYSTEM);
        }
    }
    umask(old);
    g_ctlfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    struct stat st;
    if (g_ctlfd < 0 || fstat(g_ctlfd, &st) != 0) {
        td_warn("cannot open %s: %s", dir, strerror(errno));
        RETURN(CUDA_ERROR_OPERATING_SYSTEM);
    }
    g_ctl_dev = st.st_dev;
    g_ctl_ino = st.st_ino;
    if (cfg.fdmode == FD_CHR) {
        g_chrfd = open(TD_CHRDEV, O_RDONLY | O_CLOEXEC);
        if (g_chrfd < 0 || fstat(g_chrfd, &st) != 0 || !S_ISCHR(st.st_mode)) {
            td_warn("cannot open %s: %s", TD_CHRDEV, strerror(errno));
            RETURN(CUDA_ERROR_OPERATING_SYSTEM);
        }
        g_chr_rdev = st.st_rdev;
    }
    for (int i = 0; i < cfg.nphys; i++)
        if (dev_dirfd(i) < 0) RETURN(CUDA_ERROR_OPERATING_SYSTEM);
    int sfd = open(cfg.state, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (sfd < 0 || !(g_local = machine_new(sfd))) {
        td_warn("cannot open state directory %s: %s", cfg.state, strerror(errno));
        RETURN(CUDA_ERROR_OPERATING_SYSTEM);
    }
    g_inited = true;
    RETURN(CUDA_SUCCESS);
}

CUresult CUDAAPI cuDeviceGetCount(int *count) {
    ENTER(cuDeviceGetCount);
    if (!count) RETURN(CUDA_ERROR_INVALID_VALUE);
    *count = cfg.nvis;
    RETURN(CUDA_SUCCESS);
}

CUresult CUDAAPI cuDeviceGet(CUdevice *device, int ordinal) {
    ENTER(cuDeviceGet);
    if (!device) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (!valid_ordinal(ordinal)) RETURN(CUDA_ERROR_INVALID_DEVICE);
    *device = ordinal;
    RETURN(CUDA_SUCCESS);
}

CUresult CUDAAPI cuDeviceGetName(char *name, int len, CUdevice dev) {
    ENTER(cuDeviceGetName);
    if (!name || len <= 0) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (!valid_ordinal(dev)) RETURN(CUDA_ERROR_INVALID_DEVICE);
    snprintf(name, (size_t)len, "kvcached test device %d", cfg.vis[dev]);
    RETURN(CUDA_SUCCESS);
}

static CUresult get_uuid(CUuuid *uuid, CUdevice dev) {
    if (!uuid) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ordinal(dev)) return CUDA_ERROR_INVALID_DEVICE;
    memcpy(uuid->bytes, cfg.uuid[cfg.vis[dev]], 16);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) {
    ENTER(cuDeviceGetUuid_v2);
    RETURN(get_uuid(uuid, dev));
}

CUresult CUDAAPI cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
    ENTER(cuDeviceGetUuid);
    RETURN(get_uuid(uuid, dev));
}

CUresult CUDAAPI cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev) {
    ENTER(cuDeviceGetAttribute);
    if (!pi) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (!valid_ordinal(dev)) RETURN(CUDA_ERROR_INVALID_DEVICE);
    int phys = cfg.vis[dev];
    switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: *pi = !cfg.no_vmm[phys]; break;
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: *pi = !cfg.no_posix_fd[phys]; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: *pi = 1; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *pi = 8; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *pi = 0; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *pi = 108; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: *pi = 0; break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: *pi = 0x10 + phys; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: *pi = 0; break;
    default:
        /* Attributes the project does not query are not simulated: a new
         * query fails loudly here instead of getting an invented value. */
        RETURN(CUDA_ERROR_INVALID_VALUE);
    }
    RETURN(CUDA_SUCCESS);
}

CUresult CUDAAPI cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    ENTER(cuDeviceTotalMem_v2);
    if (!bytes) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (!valid_ordinal(dev)) RETURN(CUDA_ERROR_INVALID_DEVICE);
    *bytes = cfg.memory;
    RETURN(CUDA_SUCCESS);
}

/* A context's hidden device memory (KVCACHED_TESTDRV_CONTEXT_BYTES): an
 * entry of the device directory this process holds LOCK_SH on while the
 * context lives, counted like a page by every process. */
static CUresult ctx_overhead_take(struct CUctx_st *c) {
    if (!cfg.ctx_bytes) return CUDA_SUCCESS;
    int phys = c->phys;
    int dfd = dev_dirfd(phys);
    int lfd = device_lock(phys);
    if (dfd < 0 || lfd < 0) return CUDA_ERROR_OPERATING_SYSTEM;
    if (!device_reserve(phys, lfd, cfg.ctx_bytes)) {
        device_unlock(phys);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult r = CUDA_ERROR_OPERATING_SYSTEM;
    char name[48];
    for (int attempt = 0; attempt < 1000; attempt++) {
        c->overhead_key = (uint32_t)td_random();
        snprintf(name, sizeof name, "c%08x.%zx", c->overhead_key, cfg.ctx_bytes);
        if (mkdirat(dfd, name, 0777) == 0) {
            c->overhead_fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
            if (c->overhead_fd >= 0 && flock(c->overhead_fd, LOCK_SH) == 0) r = CUDA_SUCCESS;
            else unlinkat(dfd, name, AT_REMOVEDIR);
            break;
        }
        if (errno != EEXIST) break;
    }
    device_unlock(phys);
    return r;
}

static void ctx_overhead_drop(struct CUctx_st *c) {
    if (c->overhead_fd < 0) return;
    close(c->overhead_fd);
    c->overhead_fd = -1;
    int dfd = dev_dirfd(c->phys);
    char name[48];
    snprintf(name, sizeof name, "c%08x.%zx", c->overhead_key, cfg.ctx_bytes);
    int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
    if (fd >= 0) {
        if (flock(fd, LOCK_EX | LOCK_NB) == 0) unlinkat(dfd, name, AT_REMOVEDIR);
        close(fd);
    }
}

CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    ENTER(cuDevicePrimaryCtxRetain);
    if (!pctx) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (!valid_ordinal(dev)) RETURN(CUDA_ERROR_INVALID_DEVICE);
    if (g_ctx[dev].refcount == 0) {
        CUresult r = ctx_overhead_take(&g_ctx[dev]);
        if (r) RETURN(r);
    }
    g_ctx[dev].refcount++;
    g_ctx[dev].active = true;
    *pctx = &g_ctx[dev];
    RETURN(CUDA_SUCCESS);
}

CUresult CUDAAPI cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    ENTER(cuDevicePrimaryCtxRelease_v2);
    if (!valid_ordinal(dev)) RETURN(CUDA_ERROR_INVALID_DEVICE);
    if (g_ctx[dev].refcount <= 0) RETURN(CUDA_ERROR_INVALID_CONTEXT);
    if (--g_ctx[dev].refcount == 0) {
        g_ctx[dev].active = false; /* destroyed; still "current" where it was */
        ctx_drop(&g_ctx[dev]);     /* work never synchronised is lost with it */
        ctx_overhead_drop(&g_ctx[dev]);
    }
    RETURN(CUDA_SUCCESS);
}

CUresult CUDAAPI cuCtxSetCurrent(CUcontext ctx) {
    ENTER(cuCtxSetCurrent);
    if (ctx) {
        if (ctx < &g_ctx[0] || ctx >= &g_ctx[TD_MAX_DEVICES] || ctx->magic != TD_CTX_MAGIC || !ctx->active)
            RETURN(CUDA_ERROR_INVALID_CONTEXT);
    }
    t_current = ctx;
    RETURN(CUDA_SUCCESS);
}

CUresult CUDAAPI cuCtxGetCurrent(CUcontext *pctx) {
    ENTER(cuCtxGetCurrent);
    if (!pctx) RETURN(CUDA_ERROR_INVALID_VALUE);
    *pctx = t_current;
    RETURN(CUDA_SUCCESS);
}

CUresult CUDAAPI cuCtxGetDevice(CUdevice *device) {
    ENTER(cuCtxGetDevice);
    if (!device) RETURN(CUDA_ERROR_INVALID_VALUE);
    struct CUctx_st *c;
    CUresult r = need_ctx(&c);
    if (r) RETURN(r);
    *device = c->ordinal;
    RETURN(CUDA_SUCCESS);
}

CUresult CUDAAPI cuCtxSynchronize(void) {
    ENTER(cuCtxSynchronize);
    struct CUctx_st *c;
    CUresult r = need_ctx(&c);
    if (r) RETURN(r);
    ctx_flush(c);
    RETURN(CUDA_SUCCESS);
}

CUresult CUDAAPI cuMemGetInfo_v2(size_t *free_, size_t *total) {
    ENTER(cuMemGetInfo_v2);
    if (!free_ || !total) RETURN(CUDA_ERROR_INVALID_VALUE);
    struct CUctx_st *c;
    CUresult r = need_ctx(&c);
    if (r) RETURN(r);
    int lfd = device_lock(c->phys);
    if (lfd < 0) RETURN(CUDA_ERROR_OPERATING_SYSTEM);
    size_t used = scan_used(c->phys);
    uint64_t bound = used;
    if (!g_lock_ro[c->phys] && pwrite(lfd, &bound, sizeof bound, 0) != (ssize_t)sizeof bound)
        td_warn("cannot update the device bound");
    device_unlock(c->phys);
    size_t cap = capacity(c->phys);
    *total = cfg.memory;
    *free_ = used >= cap ? 0 : cap - used;
    RETURN(CUDA_SUCCESS);
}

static CUresult check_prop(const CUmemAllocationProp *prop, int *phys) {
    if (!prop) return CUDA_ERROR_INVALID_VALUE;
    if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED) return CUDA_ERROR_INVALID_VALUE;
    if (prop->location.type == CU_MEM_LOCATION_TYPE_INVALID) return CUDA_ERROR_INVALID_VALUE;
    if (prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_NOT_SUPPORTED;
    if (!valid_ordinal(prop->location.id)) return CUDA_ERROR_INVALID_DEVICE;
    *phys = cfg.vis[prop->location.id];
    if (cfg.no_vmm[*phys]) return CUDA_ERROR_NOT_SUPPORTED;
    if (prop->requestedHandleTypes & ~CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
    if ((prop->requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) && cfg.no_posix_fd[*phys])
        return CUDA_ERROR_NOT_SUPPORTED;
    if (prop->win32HandleMetaData) return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                               CUmemAllocationGranularity_flags option) {
    ENTER(cuMemGetAllocationGranularity);
    if (!granularity) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    int phys;
    CUresult r = check_prop(prop, &phys);
    if (r) RETURN(r);
    *granularity = cfg.gran;
    RETURN(CUDA_SUCCESS);
}

CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                             unsigned long long flags) {
    td_cost(FN_cuMemCreate, size);
    ENTER(cuMemCreate);
    if (!handle || flags != 0) RETURN(CUDA_ERROR_INVALID_VALUE);
    int phys;
    CUresult r = check_prop(prop, &phys);
    if (r) RETURN(r);
    if (size == 0 || size % cfg.gran) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (size > capacity(phys)) RETURN(CUDA_ERROR_OUT_OF_MEMORY);

    int lfd = device_lock(phys);
    if (lfd < 0) RETURN(CUDA_ERROR_OPERATING_SYSTEM);
    if (!device_reserve(phys, lfd, size)) {
        device_unlock(phys);
        RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    }
    struct td_alloc *a = NULL;
    r = create_page(phys, size, &a);
    device_unlock(phys);
    if (r) RETURN(r);
    a->exportable = (prop->requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != 0;
    r = handle_new(a, false, handle);
    if (r) alloc_unref(a);
    RETURN(r);
}

CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle) {
    ENTER(cuMemRelease);
    struct td_handle *h = handle_get(handle);
    if (!h) RETURN(CUDA_ERROR_INVALID_VALUE);
    struct td_alloc *a = h->alloc;
    h->alloc = NULL;
    g_livehandles--;
    alloc_unref(a);
    RETURN(CUDA_SUCCESS);
}

/* A new exported fd for `a` (see the model at the top), or -1 with errno. */
static int export_fd(struct td_alloc *a, uint64_t *secret_out) {
    int fd = -1;
    *secret_out = a->secret;
    char name[32];
    page_name(a->key, name);
    int dfd = machine_devfd(a->m, a->phys);
    if (cfg.fdmode == FD_DISTINCT) {
        if (a->dirfd >= 0) {
            fd = fcntl(a->dirfd, F_DUPFD_CLOEXEC, 0);
        } else { /* REFS=table: a description of the page directory of its own, pinning the page */
            fd = dfd < 0 ? -1 : openat(dfd, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
            if (fd >= 0 && (flock(fd, LOCK_SH) != 0 || lseek(fd, (off_t)a->secret, SEEK_SET) != (off_t)a->secret)) {
                int e = errno;
                close(fd);
                errno = e;
                fd = -1;
            }
        }
    } else if (cfg.fdmode == FD_SAME) {
        fd = openat(a->m->ctlfd >= 0 ? a->m->ctlfd : g_ctlfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        struct flock l = {.l_type = F_RDLCK, .l_whence = SEEK_SET, .l_start = (off_t)a->key, .l_len = 1};
        if (fd >= 0 && (lseek(fd, (off_t)a->secret, SEEK_SET) != (off_t)a->secret || fcntl(fd, F_OFD_SETLK, &l) != 0)) {
            int e = errno;
            close(fd);
            errno = e;
            fd = -1;
        }
    } else if (cfg.fdmode == FD_CHR) {
        fd = open(TD_CHRDEV, O_WRONLY | O_CLOEXEC);
        int e = EAGAIN;
        for (int i = 0; fd >= 0 && i < 256; i++) { /* a free slot: random, then the next ones */
            uint64_t slot = ((uint64_t)td_random() + (uint64_t)i) & (((uint64_t)1 << TD_CHR_SLOTS) - 1);
            struct flock l = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = (off_t)(a->secret | slot), .l_len = 1};
            if (fcntl(fd, F_OFD_SETLK, &l) == 0) {
                e = 0;
                break;
            }
            if (errno != EAGAIN && errno != EACCES) {
                e = errno;
                break;
            }
        }
        if (fd >= 0 && e) {
            close(fd);
            errno = e == EAGAIN ? EMFILE : e;
            fd = -1;
        }
        *secret_out = 0; /* the description has no offset to check */
    } else {
        strcat(name, "/data");
        fd = dfd < 0 ? -1 : openat(dfd, name, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
        if (fd >= 0 && flock(fd, LOCK_SH) != 0) {
            close(fd);
            fd = -1;
        }
        *secret_out = 0;
    }
    return fd;
}

CUresult CUDAAPI cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                              CUmemAllocationHandleType handleType, unsigned long long flags) {
    ENTER(cuMemExportToShareableHandle);
    if (!shareableHandle || flags != 0) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        RETURN(handleType == CU_MEM_HANDLE_TYPE_NONE ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_SUPPORTED);
    struct td_handle *h = handle_get(handle);
    if (!h) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (!h->alloc->exportable) RETURN(CUDA_ERROR_INVALID_VALUE);
    uint64_t secret;
    int fd = export_fd(h->alloc, &secret);
    if (fd < 0) RETURN(errno == EMFILE || errno == ENFILE ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_OPERATING_SYSTEM);
    struct stat st;
    if (fstat(fd, &st) != 0) {
        close(fd);
        RETURN(CUDA_ERROR_OPERATING_SYSTEM);
    }
    if (g_nexports == g_capexports) {
        if (g_nexports > 2 * g_exports_pruned_at + 64) exports_prune();
        if (g_nexports == g_capexports) {
            size_t cap = g_capexports ? g_capexports * 2 : 256;
            struct td_export *n = realloc(g_exports, cap * sizeof *n);
            if (!n) {
                close(fd);
                RETURN(CUDA_ERROR_OUT_OF_MEMORY);
            }
            g_exports = n;
            g_capexports = cap;
        }
    }
    g_exports[g_nexports++] = (struct td_export){fd, st.st_dev, st.st_ino, secret, handle, h->alloc->size, h->alloc->phys};
    *(int *)shareableHandle = fd;
    RETURN(CUDA_SUCCESS);
}

CUresult CUDAAPI cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                                CUmemAllocationHandleType shHandleType) {
    ENTER(cuMemImportFromShareableHandle);
    if (!handle) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        RETURN(shHandleType == CU_MEM_HANDLE_TYPE_NONE ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_SUPPORTED);
    intptr_t v = (intptr_t)osHandle; /* the fd travels by value */
    if (v < 0 || v > INT_MAX) RETURN(CUDA_ERROR_INVALID_VALUE);
    int fd = (int)v;
    struct stat st;
    if (fstat(fd, &st) != 0) RETURN(CUDA_ERROR_INVALID_VALUE);
    uint32_t key;
    uint64_t secret = 0;
    int pagefd = -1; /* a fresh description of the page directory */
    if (S_ISDIR(st.st_mode)) {
        /* an export: its offset is S = L << 32 | secret (a page directory
         * opened by path has offset 0 and is refused). Everything is found
         * relative to the fd, so any process holding it can import. */
        off_t pos = lseek(fd, 0, SEEK_CUR);
        if (pos <= 0) RETURN(CUDA_ERROR_INVALID_VALUE);
        secret = (uint64_t)pos;
        key = (uint32_t)(secret >> 32);
        int phys = (int)(key >> TD_KEY_DEV_SHIFT);
        if (phys >= cfg.nphys) RETURN(CUDA_ERROR_INVALID_VALUE);
        char name[48];
        struct stat ps;
        int parent = openat(fd, "..", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (parent < 0) RETURN(CUDA_ERROR_INVALID_VALUE);
        if (fstatat(parent, TD_CTL, &ps, AT_SYMLINK_NOFOLLOW) == 0 && ps.st_dev == st.st_dev && ps.st_ino == st.st_ino) {
            /* "same" identity: a description of nvidiactl whose OFD lock on
             * byte L keeps the page; taking it on this description is a
             * no-op for a real export */
            struct flock l = {.l_type = F_RDLCK, .l_whence = SEEK_SET, .l_start = (off_t)key, .l_len = 1};
            snprintf(name, sizeof name, "dev%d/p%08x", phys, key);
            if (fcntl(fd, F_OFD_SETLK, &l) == 0) pagefd = openat(parent, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
        } else {
            /* "distinct": the fd must be the page directory itself */
            page_name(key, name);
            if (fstatat(parent, name, &ps, AT_SYMLINK_NOFOLLOW) == 0 && ps.st_dev == st.st_dev && ps.st_ino == st.st_ino)
                pagefd = openat(fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        }
        close(parent);
        if (pagefd < 0) RETURN(CUDA_ERROR_INVALID_VALUE);
    } else if (S_ISCHR(st.st_mode) && cfg.fdmode == FD_CHR && st.st_rdev == g_chr_rdev && g_local) {
        /* "chardev": the description's own OFD lock (its fdinfo) names S | slot */
        char path[64], line[256];
        snprintf(path, sizeof path, "/proc/self/fdinfo/%d", fd);
        FILE *f = fopen(path, "re");
        if (!f) RETURN(CUDA_ERROR_INVALID_VALUE);
        unsigned long long start = 0, end = 0, found = 0;
        while (fgets(line, sizeof line, f)) {
            if (strncmp(line, "lock:", 5) != 0 || !strstr(line, "OFDLCK") || !strstr(line, "WRITE")) continue;
            char *p = strrchr(line, ' '); /* "... START END" */
            if (!p) continue;
            end = strtoull(p + 1, NULL, 10);
            *p = 0;
            char *q = strrchr(line, ' ');
            if (!q) continue;
            start = strtoull(q + 1, NULL, 10);
            if (start == end && (start >> 32)) {
                found = start;
                break;
            }
        }
        fclose(f);
        if (!found) RETURN(CUDA_ERROR_INVALID_VALUE);
        secret = found & ~(((uint64_t)1 << TD_CHR_SLOTS) - 1);
        key = (uint32_t)(secret >> 32);
        int phys = (int)(key >> TD_KEY_DEV_SHIFT);
        if (phys >= cfg.nphys) RETURN(CUDA_ERROR_INVALID_VALUE);
        char name[16];
        page_name(key, name);
        int dfd = machine_devfd(g_local, phys);
        pagefd = dfd < 0 ? -1 : openat(dfd, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
        if (pagefd < 0) RETURN(CUDA_ERROR_INVALID_VALUE);
    } else if (S_ISREG(st.st_mode) && cfg.fdmode == FD_FILE) {
        /* lenient: the page's data file (any description of it, even one opened by path) */
        struct td_trailer t;
        if (st.st_size < (off_t)(TD_TRAILER + cfg.gran) ||
            pread(fd, &t, sizeof t, st.st_size - (off_t)TD_TRAILER) != (ssize_t)sizeof t ||
            memcmp(t.magic, TD_MAGIC, 8) != 0 || t.phys >= (uint32_t)cfg.nphys)
            RETURN(CUDA_ERROR_UNKNOWN); /* a file this driver did not export */
        key = t.key;
        char link[64], path[PATH_MAX];
        snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
        ssize_t n = readlink(link, path, sizeof path - 1);
        char *slash = n > 0 ? memrchr(path, '/', (size_t)n) : NULL;
        if (!slash) RETURN(CUDA_ERROR_INVALID_VALUE);
        *slash = 0; /* the page directory the file is in */
        pagefd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (pagefd < 0) RETURN(CUDA_ERROR_INVALID_VALUE);
    } else {
        /* not an fd this driver exported: NVIDIA's driver answers a memfd
         * with CUDA_ERROR_UNKNOWN (H200, driver 580.159.04) */
        RETURN(CUDA_ERROR_UNKNOWN);
    }
    int phys = (int)(key >> TD_KEY_DEV_SHIFT);
    if (ordinal_of_phys(phys) < 0) {
        close(pagefd);
        RETURN(CUDA_ERROR_NOT_SUPPORTED); /* device not visible here */
    }
    struct td_alloc *a = NULL;
    CUresult r = open_page(pagefd, phys, key, secret, &a);
    if (r) RETURN(r);
    a->exportable = true;
    r = handle_new(a, true, handle);
    if (r) alloc_unref(a);
    RETURN(r);
}

CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                     unsigned long long flags) {
    ENTER(cuMemAddressReserve);
    if (!ptr || flags != 0 || size == 0 || size % (size_t)g_pagesize || addr % (size_t)g_pagesize)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    if (alignment & (alignment - 1)) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (alignment < cfg.gran) alignment = cfg.gran;
    size_t span = size + alignment;
    void *p = mmap((void *)(uintptr_t)addr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    uintptr_t base = ((uintptr_t)p + alignment - 1) & ~(uintptr_t)(alignment - 1);
    if (base > (uintptr_t)p) munmap(p, base - (uintptr_t)p);
    uintptr_t tail = base + size, pend = (uintptr_t)p + span;
    if (pend > tail) munmap((void *)tail, pend - tail);

    struct td_resv *r = calloc(1, sizeof *r);
    size_t nslots = (size + cfg.gran - 1) / cfg.gran;
    struct td_map **slots = calloc(nslots, sizeof *slots);
    if (r && slots && g_nresv == g_capresv) {
        size_t cap = g_capresv ? g_capresv * 2 : 16;
        struct td_resv **n = realloc(g_resv, cap * sizeof *n);
        if (n) {
            g_resv = n;
            g_capresv = cap;
        }
    }
    if (r && slots && g_nresv < g_capresv) {
        *r = (struct td_resv){base, size, nslots, slots};
        g_resv[g_nresv++] = r;
        *ptr = (CUdeviceptr)base;
        RETURN(CUDA_SUCCESS);
    }
    free(r);
    free(slots);
    munmap((void *)base, size);
    RETURN(CUDA_ERROR_OUT_OF_MEMORY);
}

CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    ENTER(cuMemAddressFree);
    for (size_t i = 0; i < g_nresv; i++) {
        struct td_resv *r = g_resv[i];
        if (r->base != (uintptr_t)ptr || r->size != size) continue;
        for (size_t s = 0; s < r->nslots; s++)
            if (r->slots[s]) RETURN(CUDA_ERROR_INVALID_VALUE); /* still mapped: unmap first */
        munmap((void *)r->base, r->size);
        free(r->slots);
        free(r);
        g_resv[i] = g_resv[--g_nresv];
        RETURN(CUDA_SUCCESS);
    }
    RETURN(CUDA_ERROR_INVALID_VALUE);
}

CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                          unsigned long long flags) {
    td_cost(FN_cuMemMap, size);
    ENTER(cuMemMap);
    if (flags != 0) RETURN(CUDA_ERROR_INVALID_VALUE);
    /* a mapping starts at offset 0 of its handle: NVIDIA's driver answers a
     * granularity-aligned offset with NOT_SUPPORTED (seen on an H200,
     * driver 580.159.04: docs/gpu-results) */
    if (offset != 0) RETURN(offset % cfg.gran ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_SUPPORTED);
    struct td_handle *h = handle_get(handle);
    if (!h) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (size == 0 || size % cfg.gran || (uintptr_t)ptr % cfg.gran || size > h->alloc->size)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    struct td_resv *r = resv_find((uintptr_t)ptr, size);
    if (!r) RETURN(CUDA_ERROR_INVALID_VALUE);
    size_t first = ((uintptr_t)ptr - r->base) / cfg.gran, n = size / cfg.gran;
    for (size_t s = first; s < first + n; s++)
        if (r->slots[s]) RETURN(CUDA_ERROR_NOT_SUPPORTED); /* already mapped: NOT_SUPPORTED, as NVIDIA's driver (H200) */
    struct td_map *m = calloc(1, sizeof *m);
    if (!m) RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    m->va = (uintptr_t)ptr;
    m->size = size;
    m->alloc = h->alloc;
    h->alloc->refs++;
    for (size_t s = first; s < first + n; s++) r->slots[s] = m;
    g_livemaps++;
    /* The address itself stays PROT_NONE: the CPU cannot touch device memory. */
    RETURN(CUDA_SUCCESS);
}

CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size) {
    td_cost(FN_cuMemUnmap, size);
    ENTER(cuMemUnmap);
    struct td_resv *r = resv_find((uintptr_t)ptr, size);
    if (r && size > 0 && size % cfg.gran == 0 && ((uintptr_t)ptr - r->base) % cfg.gran == 0 &&
        nothing_mapped(r, (uintptr_t)ptr, size))
        RETURN(CUDA_SUCCESS); /* a reserved range with nothing mapped: a no-op, as NVIDIA's driver (H200) */
    if (!r || !whole_mappings(r, (uintptr_t)ptr, size)) RETURN(CUDA_ERROR_INVALID_VALUE);
    ops_purge((uintptr_t)ptr, size);
    uintptr_t cur = (uintptr_t)ptr, end = cur + size;
    while (cur < end) {
        struct td_map *m = slot_at(r, cur);
        size_t first = (m->va - r->base) / cfg.gran, n = m->size / cfg.gran;
        for (size_t s = first; s < first + n; s++) r->slots[s] = NULL;
        cur += m->size;
        alloc_unref(m->alloc);
        free(m);
        g_livemaps--;
    }
    RETURN(CUDA_SUCCESS);
}

CUresult CUDAAPI cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    td_cost(FN_cuMemSetAccess, size);
    ENTER(cuMemSetAccess);
    if (!desc || count == 0) RETURN(CUDA_ERROR_INVALID_VALUE);
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE) RETURN(CUDA_ERROR_INVALID_VALUE);
        /* no such device: INVALID_VALUE, as NVIDIA's driver (H200) */
        if (!valid_ordinal(desc[i].location.id)) RETURN(CUDA_ERROR_INVALID_VALUE);
        if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE && desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
            desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            RETURN(CUDA_ERROR_INVALID_VALUE);
    }
    struct td_resv *r = resv_find((uintptr_t)ptr, size);
    /* "a fully mapped address range containing all allocations" */
    if (!r || !whole_mappings(r, (uintptr_t)ptr, size)) RETURN(CUDA_ERROR_INVALID_VALUE);
    uintptr_t cur = (uintptr_t)ptr, end = cur + size;
    /* access for a device other than the memory's own only between peers
     * (KVCACHED_TESTDRV_PEERS; none by default) */
    while (cur < end) {
        struct td_map *m = slot_at(r, cur);
        for (size_t i = 0; i < count; i++)
            if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE && !cfg.peer[cfg.vis[desc[i].location.id]][m->alloc->phys])
                RETURN(CUDA_ERROR_INVALID_DEVICE);
        cur += m->size;
    }
    for (cur = (uintptr_t)ptr; cur < end;) {
        struct td_map *m = slot_at(r, cur);
        for (size_t i = 0; i < count; i++) m->access[cfg.vis[desc[i].location.id]] = (unsigned char)desc[i].flags;
        cur += m->size;
    }
    RETURN(CUDA_SUCCESS);
}

CUresult CUDAAPI cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N) {
    ENTER(cuMemsetD8_v2);
    struct CUctx_st *c;
    CUresult r = need_ctx(&c);
    if (r) RETURN(r);
    if (N == 0) RETURN(CUDA_SUCCESS);
    struct td_resv *rv;
    r = range_check((uintptr_t)dstDevice, N, CU_MEM_ACCESS_FLAGS_PROT_READWRITE, c, &rv);
    if (r) RETURN(r);
    /* asynchronous with respect to the host: lands at the next synchronise
     * (or before the next synchronous copy of this context's stream) */
    if (cfg.async != ASYNC_OFF)
        RETURN(op_push(c, (struct td_op){OP_SET, (uintptr_t)dstDevice, N, uc, NULL}));
    range_do(rv, (uintptr_t)dstDevice, N, OP_SET, NULL, uc);
    RETURN(CUDA_SUCCESS);
}

CUresult CUDAAPI cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount) {
    ENTER(cuMemcpyHtoD_v2);
    struct CUctx_st *c;
    CUresult r = need_ctx(&c);
    if (r) RETURN(r);
    if (ByteCount == 0) RETURN(CUDA_SUCCESS);
    if (!srcHost) RETURN(CUDA_ERROR_INVALID_VALUE);
    struct td_resv *rv;
    r = range_check((uintptr_t)dstDevice, ByteCount, CU_MEM_ACCESS_FLAGS_PROT_READWRITE, c, &rv);
    if (r) RETURN(r);
    if (cfg.async == ASYNC_ALL) {
        /* from pageable memory the call may return before the DMA lands:
         * the bytes are staged now and land at the next synchronise */
        unsigned char *copy = malloc(ByteCount);
        if (!copy) RETURN(CUDA_ERROR_OUT_OF_MEMORY);
        memcpy(copy, srcHost, ByteCount);
        r = op_push(c, (struct td_op){OP_WRITE, (uintptr_t)dstDevice, ByteCount, 0, copy});
        if (r) free(copy);
        RETURN(r);
    }
    ctx_flush_blocking(c); /* stream order: earlier memsets first */
    range_do(rv, (uintptr_t)dstDevice, ByteCount, OP_WRITE, (unsigned char *)(uintptr_t)srcHost, 0);
    RETURN(CUDA_SUCCESS);
}

CUresult CUDAAPI cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
    ENTER(cuMemcpyDtoH_v2);
    struct CUctx_st *c;
    CUresult r = need_ctx(&c);
    if (r) RETURN(r);
    if (ByteCount == 0) RETURN(CUDA_SUCCESS);
    if (!dstHost) RETURN(CUDA_ERROR_INVALID_VALUE);
    struct td_resv *rv;
    r = range_check((uintptr_t)srcDevice, ByteCount, CU_MEM_ACCESS_FLAGS_PROT_READ, c, &rv);
    if (r) RETURN(r);
    /* synchronous, and ordered after the work issued before it on the
     * context's stream (and the streams that synchronise with it): that work
     * lands first */
    ctx_flush_blocking(c);
    range_do(rv, (uintptr_t)srcDevice, ByteCount, OP_READ, dstHost, 0);
    RETURN(CUDA_SUCCESS);
}

/* --------------------------------------------------------------------- */
/* streams and events                                                     */

static struct CUstream_st *stream_get(CUstream h) {
    for (struct CUstream_st *s = g_streams; s; s = s->next)
        if (s == h) return s->magic == TD_STREAM_MAGIC ? s : NULL;
    return NULL;
}

static struct CUevent_st *event_get(CUevent h) {
    for (struct CUevent_st *e = g_events; e; e = e->next)
        if (e == h) return e->magic == TD_EVENT_MAGIC ? e : NULL;
    return NULL;
}

/* The stream a call names, for the current context `c`: NULL (and
 * CU_STREAM_LEGACY / CU_STREAM_PER_THREAD) is the context's own; another
 * must be a live stream of this context. */
static CUresult stream_for(CUstream h, struct CUctx_st *c, struct CUstream_st **out) {
    *out = NULL;
    if (h == NULL || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) return CUDA_SUCCESS;
    struct CUstream_st *s = stream_get(h);
    if (!s) return CUDA_ERROR_INVALID_HANDLE;
    if (s->ctx != c || !c->active) return CUDA_ERROR_INVALID_CONTEXT;
    *out = s;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamCreate(CUstream *phStream, unsigned int Flags) {
    ENTER(cuStreamCreate);
    if (!phStream || (Flags & ~(unsigned)CU_STREAM_NON_BLOCKING)) RETURN(CUDA_ERROR_INVALID_VALUE);
    struct CUctx_st *c;
    CUresult r = need_ctx(&c);
    if (r) RETURN(r);
    struct CUstream_st *s = calloc(1, sizeof *s);
    if (!s) RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    *s = (struct CUstream_st){.magic = TD_STREAM_MAGIC, .ctx = c, .flags = Flags, .next = g_streams};
    g_streams = s;
    g_nstreams++;
    *phStream = s;
    RETURN(CUDA_SUCCESS);
}

/* Work still queued on a destroyed stream completes (the driver lets it
 * finish): it lands now. */
CUresult CUDAAPI cuStreamDestroy_v2(CUstream hStream) {
    ENTER(cuStreamDestroy_v2);
    struct CUstream_st *s = stream_get(hStream);
    if (!s) RETURN(CUDA_ERROR_INVALID_HANDLE);
    stream_land(s, s->q.nops);
    for (struct CUstream_st **p = &g_streams; *p; p = &(*p)->next)
        if (*p == s) {
            *p = s->next;
            break;
        }
    for (struct CUevent_st *e = g_events; e; e = e->next)
        if (e->stream == s) e->stream = NULL, e->mark = 0;
    free(s->q.ops);
    s->magic = 0;
    free(s);
    g_nstreams--;
    RETURN(CUDA_SUCCESS);
}

CUresult CUDAAPI cuStreamSynchronize(CUstream hStream) {
    ENTER(cuStreamSynchronize);
    struct CUctx_st *c;
    CUresult r = need_ctx(&c);
    if (r) RETURN(r);
    struct CUstream_st *s;
    if ((r = stream_for(hStream, c, &s))) RETURN(r);
    if (s) stream_land(s, s->q.nops);
    else ctx_flush_blocking(c);
    RETURN(CUDA_SUCCESS);
}

CUresult CUDAAPI cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream) {
    ENTER(cuMemsetD8Async);
    struct CUctx_st *c;
    CUresult r = need_ctx(&c);
    if (r) RETURN(r);
    struct CUstream_st *s;
    if ((r = stream_for(hStream, c, &s))) RETURN(r);
    if (N == 0) RETURN(CUDA_SUCCESS);
    struct td_resv *rv;
    r = range_check((uintptr_t)dstDevice, N, CU_MEM_ACCESS_FLAGS_PROT_READWRITE, c, &rv);
    if (r) RETURN(r);
    struct td_op op = {OP_SET, (uintptr_t)dstDevice, N, uc, NULL};
    if (cfg.async == ASYNC_OFF) {
        range_do(rv, op.va, N, OP_SET, NULL, uc);
        RETURN(CUDA_SUCCESS);
    }
    if (!s) RETURN(op_push(c, op));
    if ((r = queue_push(&s->q, op))) RETURN(r);
    s->issued++;
    RETURN(CUDA_SUCCESS);
}

CUresult CUDAAPI cuEventCreate(CUevent *phEvent, unsigned int Flags) {
    ENTER(cuEventCreate);
    if (!phEvent || (Flags & ~(unsigned)(CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS)))
        RETURN(CUDA_ERROR_INVALID_VALUE);
    if ((Flags & CU_EVENT_INTERPROCESS) && !(Flags & CU_EVENT_DISABLE_TIMING)) RETURN(CUDA_ERROR_INVALID_VALUE);
    struct CUctx_st *c;
    CUresult r = need_ctx(&c);
    if (r) RETURN(r);
    struct CUevent_st *e = calloc(1, sizeof *e);
    if (!e) RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    *e = (struct CUevent_st){.magic = TD_EVENT_MAGIC, .flags = Flags, .ctx = c, .next = g_events};
    g_events = e;
    g_nevents++;
    *phEvent = e;
    RETURN(CUDA_SUCCESS);
}

/* The event completes when the work issued on the stream before this call
 * has landed. On the context's own stream the test driver records nothing:
 * waiting for such an event lets the context's own work land. */
CUresult CUDAAPI cuEventRecord(CUevent hEvent, CUstream hStream) {
    ENTER(cuEventRecord);
    struct CUevent_st *e = event_get(hEvent);
    if (!e) RETURN(CUDA_ERROR_INVALID_HANDLE);
    struct CUctx_st *c;
    CUresult r = need_ctx(&c);
    if (r) RETURN(r);
    if (e->ctx != c) RETURN(CUDA_ERROR_INVALID_CONTEXT);
    struct CUstream_st *s;
    if ((r = stream_for(hStream, c, &s))) RETURN(r);
    e->stream = s;
    e->mark = s ? s->issued : 0;
    RETURN(CUDA_SUCCESS);
}

/* How many of the event's stream's queued operations it waits for. */
static size_t event_pending(struct CUevent_st *e) {
    if (!e->stream) return e->ctx->q.nops;
    uint64_t done = e->stream->landed;
    return e->mark > done ? (size_t)(e->mark - done) : 0;
}

static void event_land(struct CUevent_st *e) {
    if (e->stream) stream_land(e->stream, event_pending(e));
    else queue_land(&e->ctx->q, e->ctx->q.nops);
}

CUresult CUDAAPI cuEventQuery(CUevent hEvent) {
    ENTER(cuEventQuery);
    struct CUevent_st *e = event_get(hEvent);
    if (!e) RETURN(CUDA_ERROR_INVALID_HANDLE);
    if (!event_pending(e)) RETURN(CUDA_SUCCESS);
    event_land(e); /* seen pending once: done by the next query */
    RETURN(CUDA_ERROR_NOT_READY);
}

CUresult CUDAAPI cuEventSynchronize(CUevent hEvent) {
    ENTER(cuEventSynchronize);
    struct CUevent_st *e = event_get(hEvent);
    if (!e) RETURN(CUDA_ERROR_INVALID_HANDLE);
    event_land(e);
    RETURN(CUDA_SUCCESS);
}

CUresult CUDAAPI cuEventDestroy_v2(CUevent hEvent) {
    ENTER(cuEventDestroy_v2);
    struct CUevent_st *e = event_get(hEvent);
    if (!e) RETURN(CUDA_ERROR_INVALID_HANDLE);
    for (struct CUevent_st **p = &g_events; *p; p = &(*p)->next)
        if (*p == e) {
            *p = e->next;
            break;
        }
    e->magic = 0;
    free(e);
    g_nevents--;
    RETURN(CUDA_SUCCESS);
}

/* ===================================================================== */
/* load, fork and exit                                                    */

static void td_atfork_prepare(void) { LOCK(); }

static void td_atfork_parent(void) {
    tables_after_fork(); /* the child keeps the references it inherited */
    UNLOCK();
}

static void td_atfork_child(void) {
    /* the lock was held across fork() by td_atfork_prepare */
    pthread_mutex_init(&g_lock, NULL);
    if (g_inited && cfg.fork_refuse) g_forked = true;
    if (g_live && !td_live_open()) td_warn("KVCACHED_TESTDRV_CALLS: no counter file for the fork()ed child");
}

__attribute__((constructor)) static void td_load(void) {
    load_config();
    pthread_atfork(td_atfork_prepare, td_atfork_parent, td_atfork_child);
}

static void json_str(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        if (*s == '"' || *s == '\\') fprintf(f, "\\%c", *s);
        else if ((unsigned char)*s < 0x20) fprintf(f, "\\u%04x", *s);
        else fputc(*s, f);
    }
    fputc('"', f);
}

static void write_report(void) {
    if (!cfg.report[0]) return;
    /* %p -> pid, so several processes sharing one environment do not overwrite each other */
    char path[PATH_MAX];
    size_t len = 0;
    for (const char *s = cfg.report; *s && len + 24 < sizeof path; s++) {
        if (s[0] == '%' && s[1] == 'p') {
            len += (size_t)snprintf(path + len, sizeof path - len, "%d", (int)getpid());
            s++;
        } else path[len++] = *s;
    }
    path[len] = 0;
    char tmp[PATH_MAX + 16];
    snprintf(tmp, sizeof tmp, "%s.tmp%d", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) {
        td_warn("cannot write report %s: %s", tmp, strerror(errno));
        return;
    }
    exports_prune();
    size_t nres = g_nresv, nctx = 0, pending = ops_pending();
    for (int o = 0; o < cfg.nvis; o++) nctx += g_ctx[o].refcount > 0;
    char u[41], name[16];
    static const char *const fdmodes[] = {"distinct", "same", "file", "chardev"};
    static const char *const asyncs[] = {"0", "memset", "all"};
    static const char *const poisons[] = {"0", "edges", "full"};
    static const char *const refss[] = {"table", "fds"};

    fprintf(f, "{\n  \"pid\": %d,\n  \"initialized\": %s,\n", (int)getpid(), g_inited ? "true" : "false");
    fprintf(f, "  \"leaks\": %zu,\n", g_livehandles + g_nexports + g_livemaps + nres + nctx + g_nstreams + g_nevents);
    fprintf(f, "  \"sync_objects\": {\"streams\": %zu, \"events\": %zu},\n", g_nstreams, g_nevents);
    fprintf(f, "  \"counts\": {\"handles\": %zu, \"exported_fds\": %zu, \"mappings\": %zu, \"reservations\": %zu, "
               "\"primary_contexts\": %zu},\n",
            g_livehandles, g_nexports, g_livemaps, nres, nctx);
    fprintf(f, "  \"unsynchronized\": {\"pending\": %zu, \"lost\": %lu},\n", pending, g_lost_ops);
    fprintf(f, "  \"mode\": {\"fd_identity\": \"%s\", \"async\": \"%s\", \"poison\": \"%s\", \"fork\": \"%s\", "
               "\"context_bytes\": %zu, \"refs\": \"%s\"},\n",
            fdmodes[cfg.fdmode], asyncs[cfg.async], poisons[cfg.poison], cfg.fork_refuse ? "refuse" : "allow",
            cfg.ctx_bytes, refss[cfg.refs]);

    fprintf(f, "  \"handles\": [");
    bool first = true;
    for (size_t i = 0; i < g_nhandles; i++) {
        struct td_handle *h = &g_handles[i];
        if (!h->alloc) continue;
        format_uuid(cfg.uuid[h->alloc->phys], u);
        page_name(h->alloc->key, name);
        fprintf(f, "%s\n    {\"handle\": %llu, \"device\": \"%s\", \"size\": %zu, \"origin\": \"%s\", \"page\": ",
                first ? "" : ",", TD_HANDLE_BASE + i + 1, u, h->alloc->size, h->alloc->imported ? "imported" : "created");
        json_str(f, name);
        fputc('}', f);
        first = false;
    }
    fprintf(f, "%s],\n", first ? "" : "\n  ");

    fprintf(f, "  \"exported_fds\": [");
    for (size_t i = 0; i < g_nexports; i++) {
        format_uuid(cfg.uuid[g_exports[i].phys], u);
        fprintf(f, "%s\n    {\"fd\": %d, \"handle\": %llu, \"device\": \"%s\", \"size\": %zu}", i ? "," : "",
                g_exports[i].fd, (unsigned long long)g_exports[i].handle, u, g_exports[i].size);
    }
    fprintf(f, "%s],\n", g_nexports ? "\n  " : "");

    fprintf(f, "  \"mappings\": [");
    first = true;
    for (size_t i = 0; i < g_nresv; i++) {
        struct td_resv *r = g_resv[i];
        for (size_t s = 0; s < r->nslots; s++) {
            struct td_map *m = r->slots[s];
            if (!m || m->va != r->base + s * cfg.gran) continue;
            format_uuid(cfg.uuid[m->alloc->phys], u);
            page_name(m->alloc->key, name);
            fprintf(f, "%s\n    {\"va\": %" PRIuPTR ", \"size\": %zu, \"device\": \"%s\", \"page\": ", first ? "" : ",",
                    m->va, m->size, u);
            json_str(f, name);
            fputc('}', f);
            first = false;
        }
    }
    fprintf(f, "%s],\n", first ? "" : "\n  ");

    fprintf(f, "  \"reservations\": [");
    for (size_t i = 0; i < g_nresv; i++)
        fprintf(f, "%s\n    {\"va\": %" PRIuPTR ", \"size\": %zu}", i ? "," : "", g_resv[i]->base, g_resv[i]->size);
    fprintf(f, "%s],\n", g_nresv ? "\n  " : "");

    fprintf(f, "  \"primary_contexts\": [");
    first = true;
    for (int o = 0; o < cfg.nvis; o++) {
        if (g_ctx[o].refcount <= 0) continue;
        format_uuid(cfg.uuid[cfg.vis[o]], u);
        fprintf(f, "%s\n    {\"ordinal\": %d, \"device\": \"%s\", \"refcount\": %d}", first ? "" : ",", o, u,
                g_ctx[o].refcount);
        first = false;
    }
    fprintf(f, "%s],\n", first ? "" : "\n  ");

    fprintf(f, "  \"calls\": {");
    first = true;
    for (int i = 0; i < FN__COUNT; i++) {
        if (!g_calls[i]) continue;
        fprintf(f, "%s\"%s\": %lu", first ? "" : ", ", td_fn_names[i], g_calls[i]);
        first = false;
    }
    fprintf(f, "},\n  \"injected\": [");
    for (int i = 0; i < g_ninjected; i++)
        fprintf(f, "%s{\"function\": \"%s\", \"call\": %lu, \"error\": \"%s\"}", i ? ", " : "",
                td_fn_names[g_injected[i].fn], g_injected[i].call, td_err_name(g_injected[i].code));
    fprintf(f, "]\n}\n");
    if (fclose(f) != 0 || rename(tmp, path) != 0) td_warn("cannot write report %s: %s", path, strerror(errno));
}

__attribute__((destructor)) static void td_unload(void) {
    LOCK();
    /* A forked child's objects are its parent's (it cannot use them): it
     * writes no report of its own. */
    if (!g_forked) write_report();
    UNLOCK();
}
