/*
 * kvcached-service CUDA test driver: a libcuda.so.1 for machines without a GPU.
 *
 * It implements the subset of the CUDA driver API the project calls, with
 * the prototypes of NVIDIA's own cuda.h (a mismatch does not compile), and
 * enforces the rules the real driver documents. See README.md next to this
 * file for the model, the configuration and the deviations.
 *
 * Model in one paragraph. "Device memory" is one directory per physical
 * device under a state directory shared by every process of one simulated
 * machine. A page (one cuMemCreate allocation) is a file there: `size` bytes
 * of content followed by one 4 KiB trailer that identifies it. Every
 * reference to a page (a handle, a mapping, an exported fd, in any process)
 * holds the file's one open file description, on which a LOCK_SH flock was
 * taken at creation. Exported fds are dup()s of it, SCM_RIGHTS passes it,
 * imports dup() it, and the host-side view is an mmap of it (which keeps it
 * referenced), so the lock lives exactly as long as any reference anywhere.
 * A page is in use device-wide iff a fresh open of its file cannot take
 * LOCK_EX|LOCK_NB; files that can are garbage and get unlinked. Device
 * virtual addresses are PROT_NONE host reservations (the CPU faults on
 * them, as on a GPU); cuMemcpy and cuMemsetD8 reach the bytes through the
 * page's own host view.
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
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

/* cuda.h maps cuDeviceGetUuid to cuDeviceGetUuid_v2. The unversioned symbol
 * has the same prototype (non-MIG-aware UUIDs); some callers resolve it by
 * name, so export it too. The prototype is the header's own (its
 * __CUDA_API_VERSION_INTERNAL section). */
#undef cuDeviceGetUuid
__attribute__((visibility("default"))) CUresult CUDAAPI cuDeviceGetUuid(CUuuid *uuid, CUdevice dev);

#define TD_MAX_DEVICES 16
#define TD_TRAILER 4096u
#define TD_MAGIC "KVCTDPG1"
#define TD_HANDLE_BASE 0x4b5600000000ull /* handles are BASE + index + 1 */
#define TD_DEFAULT_MEMORY (1ull << 30)
#define TD_DEFAULT_GRANULARITY (2ull << 20)
#define TD_POISON_BYTE 0xdb
#define TD_POISON_SPAN 4096u

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
/* the functions, for call counting and failure injection                 */

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

struct td_alloc {
    int fd;                   /* the page's open file description (holds LOCK_SH) */
    int phys;                 /* physical device index */
    size_t size;              /* page bytes (file is size + TD_TRAILER) */
    unsigned char *host;      /* MAP_SHARED host view of the page bytes */
    char name[64];            /* file name inside devN/ */
    bool exportable;          /* created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR */
    int refs;                 /* handles + mappings in this process */
    dev_t st_dev;
    ino_t st_ino;
};

struct td_handle {
    struct td_alloc *alloc; /* NULL once released */
    bool imported;
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
    CUmemGenericAllocationHandle handle;
    size_t size;
    int phys;
};

struct CUctx_st {
    uint32_t magic;
    int ordinal;
    int phys;
    int refcount;
    bool active;
};
#define TD_CTX_MAGIC 0x6b766378u

struct td_trailer {
    char magic[8];
    uint32_t phys;
    uint32_t version;
    uint64_t size;
    char name[64];
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
    bool poison;
    char state[PATH_MAX];
    char report[PATH_MAX];
    int nvis;
    int vis[TD_MAX_DEVICES]; /* ordinal -> physical index */
    struct td_fail_rule rules[64];
    int nrules;
} cfg;

static bool g_inited;
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
static unsigned long g_page_counter;

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

static void load_config(void) {
    const char *s;
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
    long pg = sysconf(_SC_PAGESIZE);
    if (cfg.gran == 0 || (cfg.gran & (cfg.gran - 1)) || cfg.gran % (size_t)pg)
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
    s = getenv("KVCACHED_TESTDRV_POISON");
    cfg.poison = !(s && strcmp(s, "0") == 0);

    if ((s = getenv("KVCACHED_TESTDRV_STATE")) && *s) snprintf(cfg.state, sizeof cfg.state, "%s", s);
    else snprintf(cfg.state, sizeof cfg.state, "/dev/shm/kvcached-testdrv-%u", (unsigned)getuid());
    if (strlen(cfg.state) > PATH_MAX - 160) config_fail("KVCACHED_TESTDRV_STATE is too long");

    if ((s = getenv("KVCACHED_TESTDRV_REPORT")) && *s) {
        /* %p -> pid, so several processes sharing one environment do not overwrite each other */
        size_t o = 0;
        for (; *s && o + 24 < sizeof cfg.report; s++) {
            if (s[0] == '%' && s[1] == 'p') {
                o += (size_t)snprintf(cfg.report + o, sizeof cfg.report - o, "%d", (int)getpid());
                s++;
            } else cfg.report[o++] = *s;
        }
        cfg.report[o] = 0;
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
    }
    cfg.loaded = true;
}

/* --------------------------------------------------------------------- */
/* small helpers                                                          */

static CUresult td_enter(int fn) {
    unsigned long n = ++g_calls[fn];
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

#define ENTER(fn)                                          \
    LOCK();                                                \
    CUresult _inj = td_enter(FN_##fn);                     \
    if (_inj != CUDA_SUCCESS) {                            \
        UNLOCK();                                          \
        return _inj;                                       \
    }                                                      \
    if (!g_inited) {                                       \
        UNLOCK();                                          \
        return CUDA_ERROR_NOT_INITIALIZED;                 \
    }
#define RETURN(code)    \
    do {                \
        CUresult _r = (code); \
        UNLOCK();       \
        return _r;      \
    } while (0)

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

/* --------------------------------------------------------------------- */
/* device-wide accounting                                                 */

/* Bytes of pages still referenced by any process on physical device `phys`;
 * unreferenced page files are unlinked on the way. */
static size_t scan_used(int phys) {
    char dir[PATH_MAX];
    devdir(phys, dir, sizeof dir);
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) return 0;
    DIR *d = fdopendir(dfd);
    if (!d) {
        close(dfd);
        return 0;
    }
    size_t used = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        int fd = openat(dfd, e->d_name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
        if (fd < 0) continue;
        struct stat st;
        if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
            if (flock(fd, LOCK_EX | LOCK_NB) == 0) unlinkat(dfd, e->d_name, 0);
            else if (st.st_size >= (off_t)TD_TRAILER) used += (size_t)st.st_size - TD_TRAILER;
        }
        close(fd);
    }
    closedir(d);
    return used;
}

static int device_lock(int phys) {
    if (g_lockfd[phys] < 0) {
        char path[PATH_MAX];
        snprintf(path, sizeof path, "%s/dev%d/.lock", cfg.state, phys);
        g_lockfd[phys] = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
        if (g_lockfd[phys] < 0) return -1;
    }
    while (flock(g_lockfd[phys], LOCK_EX) != 0)
        if (errno != EINTR) return -1;
    return g_lockfd[phys];
}

static void device_unlock(int phys) { flock(g_lockfd[phys], LOCK_UN); }

/* Try to unlink a page file that no one references any more. */
static void try_collect(int phys, const char *name, dev_t sdev, ino_t sino) {
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/dev%d/%s", cfg.state, phys, name);
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return;
    struct stat st;
    if (fstat(fd, &st) == 0 && st.st_dev == sdev && st.st_ino == sino && flock(fd, LOCK_EX | LOCK_NB) == 0)
        unlink(path);
    close(fd);
}

/* --------------------------------------------------------------------- */
/* allocations and handles                                                */

static void alloc_unref(struct td_alloc *a) {
    if (--a->refs > 0) return;
    munmap(a->host, a->size);
    close(a->fd);
    try_collect(a->phys, a->name, a->st_dev, a->st_ino);
    free(a);
}

static CUresult handle_new(struct td_alloc *a, bool imported, CUmemGenericAllocationHandle *out) {
    if (g_nhandles == g_caphandles) {
        size_t cap = g_caphandles ? g_caphandles * 2 : 256;
        struct td_handle *n = realloc(g_handles, cap * sizeof *n);
        if (!n) return CUDA_ERROR_OUT_OF_MEMORY;
        g_handles = n;
        g_caphandles = cap;
    }
    g_handles[g_nhandles] = (struct td_handle){a, imported};
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

/* Map the page's host view and fill in the alloc (fd already set). */
static CUresult alloc_finish(struct td_alloc *a) {
    struct stat st;
    if (fstat(a->fd, &st) != 0) return CUDA_ERROR_OPERATING_SYSTEM;
    a->st_dev = st.st_dev;
    a->st_ino = st.st_ino;
    void *p = mmap(NULL, a->size, PROT_READ | PROT_WRITE, MAP_SHARED, a->fd, 0);
    if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    a->host = p;
    a->refs = 1;
    return CUDA_SUCCESS;
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

enum td_op { OP_READ, OP_WRITE, OP_SET };

static void range_do(struct td_resv *r, uintptr_t addr, size_t n, enum td_op op, unsigned char *buf, unsigned char val) {
    uintptr_t cur = addr, end = addr + n;
    long pg = sysconf(_SC_PAGESIZE);
    while (cur < end) {
        struct td_map *m = slot_at(r, cur);
        size_t off = cur - m->va;
        size_t len = m->va + m->size - cur;
        if (len > end - cur) len = end - cur;
        unsigned char *host = m->alloc->host + off;
        if (op == OP_READ) memcpy(buf, host, len);
        else if (op == OP_WRITE) memcpy(host, buf, len);
        else if (val != 0) memset(host, val, len);
        else {
            /* zeros: punch the page-aligned interior (frees the tmpfs memory,
             * every view reads zeros), memset the edges */
            size_t a0 = (off + (size_t)pg - 1) / (size_t)pg * (size_t)pg;
            size_t a1 = (off + len) / (size_t)pg * (size_t)pg;
            if (a1 > a0 &&
                fallocate(m->alloc->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)a0, (off_t)(a1 - a0)) == 0) {
                memset(host, 0, a0 - off);
                memset(m->alloc->host + a1, 0, off + len - a1);
            } else {
                memset(host, 0, len);
            }
        }
        if (buf) buf += len;
        cur += len;
    }
}

/* --------------------------------------------------------------------- */
/* exported fds                                                           */

static bool export_still_open(const struct td_export *e) {
    struct stat st;
    return fstat(e->fd, &st) == 0 && st.st_dev == e->st_dev && st.st_ino == e->st_ino;
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
    if (Flags != 0) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (cfg.config_error[0]) {
        td_warn("%s", cfg.config_error);
        RETURN(CUDA_ERROR_INVALID_VALUE);
    }
    if (g_inited) RETURN(CUDA_SUCCESS);
    if (cfg.nphys == 0 || cfg.nvis == 0) RETURN(CUDA_ERROR_NO_DEVICE);
    mode_t old = umask(0);
    for (int i = 0; i < cfg.nphys; i++) {
        char dir[PATH_MAX];
        devdir(i, dir, sizeof dir);
        if (mkdir_p(dir, 0777) != 0) {
            umask(old);
            td_warn("cannot create state directory %s: %s", dir, strerror(errno));
            RETURN(CUDA_ERROR_OPERATING_SYSTEM);
        }
    }
    umask(old);
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

CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    ENTER(cuDevicePrimaryCtxRetain);
    if (!pctx) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (!valid_ordinal(dev)) RETURN(CUDA_ERROR_INVALID_DEVICE);
    g_ctx[dev].refcount++;
    g_ctx[dev].active = true;
    *pctx = &g_ctx[dev];
    RETURN(CUDA_SUCCESS);
}

CUresult CUDAAPI cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    ENTER(cuDevicePrimaryCtxRelease_v2);
    if (!valid_ordinal(dev)) RETURN(CUDA_ERROR_INVALID_DEVICE);
    if (g_ctx[dev].refcount <= 0) RETURN(CUDA_ERROR_INVALID_CONTEXT);
    if (--g_ctx[dev].refcount == 0) g_ctx[dev].active = false; /* destroyed; still "current" where it was */
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
    RETURN(need_ctx(&c)); /* every operation here is synchronous */
}

CUresult CUDAAPI cuMemGetInfo_v2(size_t *free_, size_t *total) {
    ENTER(cuMemGetInfo_v2);
    if (!free_ || !total) RETURN(CUDA_ERROR_INVALID_VALUE);
    struct CUctx_st *c;
    CUresult r = need_ctx(&c);
    if (r) RETURN(r);
    if (device_lock(c->phys) < 0) RETURN(CUDA_ERROR_OPERATING_SYSTEM);
    size_t used = scan_used(c->phys);
    uint64_t bound = used;
    pwrite(g_lockfd[c->phys], &bound, sizeof bound, 0);
    device_unlock(c->phys);
    *total = cfg.memory;
    *free_ = used >= cfg.memory ? 0 : cfg.memory - used;
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

/* Create one page file on `phys` (caller holds the device lock). */
static CUresult create_page_file(int phys, size_t size, struct td_alloc *a) {
    char dir[PATH_MAX];
    devdir(phys, dir, sizeof dir);
    int fd = open(dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0666);
    if (fd < 0) {
        td_warn("O_TMPFILE in %s: %s", dir, strerror(errno));
        return errno == ENOSPC || errno == ENOMEM ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_OPERATING_SYSTEM;
    }
    /* the lock first: from the moment the file has a name it is in use */
    if (flock(fd, LOCK_SH) != 0 || ftruncate(fd, (off_t)(size + TD_TRAILER)) != 0) {
        int e = errno;
        close(fd);
        return e == ENOSPC || e == ENOMEM || e == EFBIG ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_OPERATING_SYSTEM;
    }
    struct td_trailer t;
    memset(&t, 0, sizeof t);
    memcpy(t.magic, TD_MAGIC, 8);
    t.phys = (uint32_t)phys;
    t.version = 1;
    t.size = size;
    memcpy(t.uuid, cfg.uuid[phys], 16);
    char proc[64];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
    for (int attempt = 0;; attempt++) {
        snprintf(t.name, sizeof t.name, "pg-%d-%lu", (int)getpid(), ++g_page_counter);
        char path[PATH_MAX];
        snprintf(path, sizeof path, "%s/%s", dir, t.name);
        if (linkat(AT_FDCWD, proc, AT_FDCWD, path, AT_SYMLINK_FOLLOW) == 0) break;
        if (errno == EEXIST && attempt < 1000) continue; /* a leftover of an earlier process with our pid */
        int e = errno;
        td_warn("linkat %s: %s", path, strerror(e));
        close(fd);
        return e == ENOSPC ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_OPERATING_SYSTEM;
    }
    if (pwrite(fd, &t, sizeof t, (off_t)size) != (ssize_t)sizeof t) {
        close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    a->fd = fd;
    a->phys = phys;
    a->size = size;
    snprintf(a->name, sizeof a->name, "%s", t.name);
    CUresult r = alloc_finish(a);
    if (r) {
        close(fd);
        return r;
    }
    if (cfg.poison) {
        /* Fresh device memory is not zero on a real GPU: make that visible */
        size_t span = size < TD_POISON_SPAN ? size : TD_POISON_SPAN;
        memset(a->host, TD_POISON_BYTE, span);
        memset(a->host + size - span, TD_POISON_BYTE, span);
    }
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                             unsigned long long flags) {
    ENTER(cuMemCreate);
    if (!handle || flags != 0) RETURN(CUDA_ERROR_INVALID_VALUE);
    int phys;
    CUresult r = check_prop(prop, &phys);
    if (r) RETURN(r);
    if (size == 0 || size % cfg.gran) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (size > cfg.memory) RETURN(CUDA_ERROR_OUT_OF_MEMORY);

    int lfd = device_lock(phys);
    if (lfd < 0) RETURN(CUDA_ERROR_OPERATING_SYSTEM);
    /* The lock file holds an upper bound of the device's used bytes; only
     * when it says "full" is the directory scanned for the exact number. */
    uint64_t bound = 0;
    if (pread(lfd, &bound, sizeof bound, 0) != (ssize_t)sizeof bound) bound = cfg.memory;
    if (bound + size > cfg.memory) bound = scan_used(phys);
    if (bound + size > cfg.memory) {
        pwrite(lfd, &bound, sizeof bound, 0);
        device_unlock(phys);
        RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    }
    struct td_alloc *a = calloc(1, sizeof *a);
    if (!a) {
        device_unlock(phys);
        RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    }
    r = create_page_file(phys, size, a);
    if (r == CUDA_SUCCESS) {
        bound += size;
        pwrite(lfd, &bound, sizeof bound, 0);
    }
    device_unlock(phys);
    if (r) {
        free(a);
        RETURN(r);
    }
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

CUresult CUDAAPI cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                              CUmemAllocationHandleType handleType, unsigned long long flags) {
    ENTER(cuMemExportToShareableHandle);
    if (!shareableHandle || flags != 0) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        RETURN(handleType == CU_MEM_HANDLE_TYPE_NONE ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_SUPPORTED);
    struct td_handle *h = handle_get(handle);
    if (!h) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (!h->alloc->exportable) RETURN(CUDA_ERROR_INVALID_VALUE);
    int fd = fcntl(h->alloc->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) RETURN(errno == EMFILE || errno == ENFILE ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_OPERATING_SYSTEM);
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
    g_exports[g_nexports++] =
        (struct td_export){fd, h->alloc->st_dev, h->alloc->st_ino, handle, h->alloc->size, h->alloc->phys};
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
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size < (off_t)(TD_TRAILER + cfg.gran))
        RETURN(CUDA_ERROR_INVALID_VALUE);
    struct td_trailer t;
    size_t size = (size_t)st.st_size - TD_TRAILER;
    if (pread(fd, &t, sizeof t, (off_t)size) != (ssize_t)sizeof t || memcmp(t.magic, TD_MAGIC, 8) != 0 ||
        t.size != size || t.phys >= (uint32_t)cfg.nphys)
        RETURN(CUDA_ERROR_INVALID_VALUE); /* not an fd this driver exported */
    if (ordinal_of_phys((int)t.phys) < 0) RETURN(CUDA_ERROR_NOT_SUPPORTED); /* device not visible here */
    struct td_alloc *a = calloc(1, sizeof *a);
    if (!a) RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    a->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0); /* same open file description: same lock */
    if (a->fd < 0) {
        free(a);
        RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    }
    flock(a->fd, LOCK_SH | LOCK_NB); /* a no-op on the exported description, which holds it already */
    a->phys = (int)t.phys;
    a->size = size;
    a->exportable = true;
    memcpy(a->name, t.name, sizeof a->name);
    a->name[sizeof a->name - 1] = 0;
    CUresult r = alloc_finish(a);
    if (r) {
        close(a->fd);
        free(a);
        RETURN(r);
    }
    r = handle_new(a, true, handle);
    if (r) alloc_unref(a);
    RETURN(r);
}

CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                     unsigned long long flags) {
    ENTER(cuMemAddressReserve);
    long pg = sysconf(_SC_PAGESIZE);
    if (!ptr || flags != 0 || size == 0 || size % (size_t)pg || addr % (size_t)pg) RETURN(CUDA_ERROR_INVALID_VALUE);
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
    ENTER(cuMemMap);
    if (flags != 0 || offset != 0) RETURN(CUDA_ERROR_INVALID_VALUE);
    struct td_handle *h = handle_get(handle);
    if (!h) RETURN(CUDA_ERROR_INVALID_VALUE);
    if (size == 0 || size % cfg.gran || (uintptr_t)ptr % cfg.gran || size > h->alloc->size)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    struct td_resv *r = resv_find((uintptr_t)ptr, size);
    if (!r) RETURN(CUDA_ERROR_INVALID_VALUE);
    size_t first = ((uintptr_t)ptr - r->base) / cfg.gran, n = size / cfg.gran;
    for (size_t s = first; s < first + n; s++)
        if (r->slots[s]) RETURN(CUDA_ERROR_INVALID_VALUE); /* already mapped */
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
    ENTER(cuMemUnmap);
    struct td_resv *r = resv_find((uintptr_t)ptr, size);
    if (!r || !whole_mappings(r, (uintptr_t)ptr, size)) RETURN(CUDA_ERROR_INVALID_VALUE);
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
    ENTER(cuMemSetAccess);
    if (!desc || count == 0) RETURN(CUDA_ERROR_INVALID_VALUE);
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE) RETURN(CUDA_ERROR_INVALID_VALUE);
        if (!valid_ordinal(desc[i].location.id)) RETURN(CUDA_ERROR_INVALID_DEVICE);
        if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE && desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
            desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            RETURN(CUDA_ERROR_INVALID_VALUE);
    }
    struct td_resv *r = resv_find((uintptr_t)ptr, size);
    /* "a fully mapped address range containing all allocations" */
    if (!r || !whole_mappings(r, (uintptr_t)ptr, size)) RETURN(CUDA_ERROR_INVALID_VALUE);
    uintptr_t cur = (uintptr_t)ptr, end = cur + size;
    while (cur < end) {
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
    range_do(rv, (uintptr_t)srcDevice, ByteCount, OP_READ, dstHost, 0);
    RETURN(CUDA_SUCCESS);
}

/* ===================================================================== */
/* load and exit                                                          */

__attribute__((constructor)) static void td_load(void) { load_config(); }

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
    char tmp[PATH_MAX + 16];
    snprintf(tmp, sizeof tmp, "%s.tmp%d", cfg.report, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) {
        td_warn("cannot write report %s: %s", tmp, strerror(errno));
        return;
    }
    exports_prune();
    size_t nres = g_nresv, nctx = 0;
    for (int o = 0; o < cfg.nvis; o++) nctx += g_ctx[o].refcount > 0;
    char u[41];

    fprintf(f, "{\n  \"pid\": %d,\n  \"initialized\": %s,\n", (int)getpid(), g_inited ? "true" : "false");
    fprintf(f, "  \"leaks\": %zu,\n", g_livehandles + g_nexports + g_livemaps + nres + nctx);
    fprintf(f, "  \"counts\": {\"handles\": %zu, \"exported_fds\": %zu, \"mappings\": %zu, \"reservations\": %zu, "
               "\"primary_contexts\": %zu},\n",
            g_livehandles, g_nexports, g_livemaps, nres, nctx);

    fprintf(f, "  \"handles\": [");
    bool first = true;
    for (size_t i = 0; i < g_nhandles; i++) {
        struct td_handle *h = &g_handles[i];
        if (!h->alloc) continue;
        format_uuid(cfg.uuid[h->alloc->phys], u);
        fprintf(f, "%s\n    {\"handle\": %llu, \"device\": \"%s\", \"size\": %zu, \"origin\": \"%s\", \"page\": ",
                first ? "" : ",", TD_HANDLE_BASE + i + 1, u, h->alloc->size, h->imported ? "imported" : "created");
        json_str(f, h->alloc->name);
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
            fprintf(f, "%s\n    {\"va\": %" PRIuPTR ", \"size\": %zu, \"device\": \"%s\", \"page\": ", first ? "" : ",",
                    m->va, m->size, u);
            json_str(f, m->alloc->name);
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
    if (fclose(f) != 0 || rename(tmp, cfg.report) != 0) td_warn("cannot write report %s: %s", cfg.report, strerror(errno));
}

__attribute__((destructor)) static void td_unload(void) {
    LOCK();
    write_report();
    UNLOCK();
}
