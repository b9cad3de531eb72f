/* Kept handles in the CUDA mapper (docs/protocol.md "Kept handles"), on the
 * project's CUDA test driver: pages made and exported in this process, mapped
 * through the session's mapper (src/mapper_cuda.c) by page id. The driver's
 * live call counters (KVCACHED_TESTDRV_CALLS, tests/cudadriver/README.md)
 * say which driver calls each step made: a page whose handle is kept maps
 * without cuMemImportFromShareableHandle and without cuMemRelease; the cache
 * keeps at most its limit and releases what does not fit; drop and reset
 * release; a failed run leaves the cache as it was; a DROP racing maps
 * (threads) never breaks a map.
 *
 *   test_keep_cuda LIBCUDA   (the test driver: build/testdriver/libcuda.so.1) */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "mapper.h"

static int failures;
#define CHECK(cond)                                                                       \
    do {                                                                                  \
        if (!(cond)) {                                                                    \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);       \
            failures++;                                                                   \
        }                                                                                 \
    } while (0)
#define CHECK_OK(expr)                                                                    \
    do {                                                                                  \
        kvc_status st_ = (expr);                                                          \
        if (st_ != KVC_OK) {                                                              \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, kvc_last_error()); \
            failures++;                                                                   \
        }                                                                                 \
    } while (0)

/* ---- the driver, for making and exporting pages here --------------------- */
typedef int CUresult;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct {
    int type, requestedHandleTypes;
    struct {
        int type, id;
    } location;
    void *win32HandleMetaData;
    unsigned char allocFlags[8];
} CUmemAllocationProp;
static CUresult (*cuInit)(unsigned);
static CUresult (*cuDeviceGet)(int *, int);
static CUresult (*cuDeviceGetUuid_v2)(unsigned char *, int);
static CUresult (*cuDevicePrimaryCtxRetain)(void **, int);
static CUresult (*cuDevicePrimaryCtxRelease_v2)(int);
static CUresult (*cuCtxSetCurrent)(void *);
static CUresult (*cuMemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                               unsigned long long);
static CUresult (*cuMemExportToShareableHandle)(void *, CUmemGenericAllocationHandle, int,
                                                unsigned long long);
static CUresult (*cuMemRelease)(CUmemGenericAllocationHandle);

static void *ctx;
static const uint64_t PAGE = 2ull << 20;

enum { NPAGES = 4 };
static CUmemGenericAllocationHandle made[NPAGES]; /* page id i+1 is made[i] */

static void load(const char *path)
{
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "cannot load %s: %s\n", path, dlerror());
        exit(1);
    }
#define SYM(name)                                                  \
    do {                                                           \
        *(void **)&name = dlsym(lib, #name);                       \
        if (!name) {                                               \
            fprintf(stderr, "%s lacks %s\n", path, #name);         \
            exit(1);                                               \
        }                                                          \
    } while (0)
    SYM(cuInit);
    SYM(cuDeviceGet);
    SYM(cuDeviceGetUuid_v2);
    SYM(cuDevicePrimaryCtxRetain);
    SYM(cuDevicePrimaryCtxRelease_v2);
    SYM(cuCtxSetCurrent);
    SYM(cuMemCreate);
    SYM(cuMemExportToShareableHandle);
    SYM(cuMemRelease);
#undef SYM
}

/* A fresh export of page id (1-based): what a PAGES record would carry. */
static int export_page(uint64_t id)
{
    int fd = -1;
    cuCtxSetCurrent(ctx);
    if (cuMemExportToShareableHandle(&fd, made[id - 1], 1 /* POSIX fd */, 0) != 0)
        abort();
    return fd;
}

/* ---- the driver's live call counters of this process --------------------- */
static char g_calls_file[512];

static uint64_t calls(const char *fn)
{
    int fd = open(g_calls_file, O_RDONLY);
    if (fd < 0)
        return ~0ull;
    struct stat sb;
    fstat(fd, &sb);
    unsigned char *p = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED)
        return ~0ull;
    uint32_t nfn, namelen;
    memcpy(&nfn, p + 12, 4);
    memcpy(&namelen, p + 20, 4);
    uint64_t v = ~0ull;
    for (uint32_t f = 0; f < nfn; f++)
        if (!strcmp((const char *)p + 32 + (size_t)f * namelen, fn))
            memcpy(&v, p + 32 + (size_t)nfn * namelen + 8 * (size_t)f, 8);
    munmap(p, (size_t)sb.st_size);
    return v;
}

struct counts {
    uint64_t import, map, release, access;
};
static struct counts now(void)
{
    struct counts c = {calls("cuMemImportFromShareableHandle"), calls("cuMemMap"),
                       calls("cuMemRelease"), calls("cuMemSetAccess")};
    return c;
}

/* Map page ids at consecutive pages from slot `at` of the reservation. */
static kvc_status map_ids(kvc_mapper *m, uintptr_t base, size_t at, const uint64_t *ids, size_t n)
{
    int fds[NPAGES];
    for (size_t i = 0; i < n; i++)
        fds[i] = export_page(ids[i]);
    return kvc_mapper_map_run_ids(m, base + at * PAGE, ids, fds, n, PAGE);
}

static void unmap_all(kvc_mapper *m, uintptr_t base, size_t from, size_t n)
{
    for (size_t i = from; i < from + n; i++)
        CHECK_OK(kvc_mapper_unmap(m, base + i * PAGE, PAGE));
}

struct race {
    kvc_mapper *m;
    uintptr_t base;
    int stop;
    int errors;
};

static void *mapper_thread(void *arg)
{
    struct race *r = arg;
    static const uint64_t ids[2] = {1, 2};
    for (int i = 0; i < 200; i++) {
        if (map_ids(r->m, r->base, 0, ids, 2) != KVC_OK) {
            fprintf(stderr, "map during DROPs: %s\n", kvc_last_error());
            __atomic_add_fetch(&r->errors, 1, __ATOMIC_RELAXED);
            continue;
        }
        for (size_t k = 0; k < 2; k++)
            if (kvc_mapper_unmap(r->m, r->base + k * PAGE, PAGE) != KVC_OK)
                __atomic_add_fetch(&r->errors, 1, __ATOMIC_RELAXED);
    }
    __atomic_store_n(&r->stop, 1, __ATOMIC_RELEASE);
    return NULL;
}

static void *dropper_thread(void *arg)
{
    struct race *r = arg;
    static const uint64_t ids[3] = {2, 1, 77};
    while (!__atomic_load_n(&r->stop, __ATOMIC_ACQUIRE)) {
        kvc_mapper_drop(r->m, ids, 3);
        usleep(50);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: test_keep_cuda LIBCUDA\n");
        return 2;
    }
    char tmpl[] = "/tmp/kvc-keep.XXXXXX";
    if (!mkdtemp(tmpl))
        return 1;
    char state[600], callsdir[600];
    snprintf(state, sizeof state, "%s/gpu", tmpl);
    snprintf(callsdir, sizeof callsdir, "%s/calls", tmpl);
    mkdir(state, 0700);
    setenv("KVCACHED_TESTDRV_STATE", state, 1);
    setenv("KVCACHED_TESTDRV_CALLS", callsdir, 1);
    setenv("KVCACHED_LIBCUDA", argv[1], 1);
    snprintf(g_calls_file, sizeof g_calls_file, "%s/%d", callsdir, (int)getpid());
    load(argv[1]);
    int dev = 0;
    unsigned char uuid[16];
    char text[41];
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDeviceGetUuid_v2(uuid, dev) ||
        cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx)) {
        fprintf(stderr, "the test driver did not start\n");
        return 1;
    }
    kvc_format_gpu_uuid(uuid, text);
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = 1;                 /* pinned */
    prop.requestedHandleTypes = 1; /* POSIX fd */
    prop.location.type = 1;        /* device */
    prop.location.id = 0;
    for (int i = 0; i < NPAGES; i++)
        if (cuMemCreate(&made[i], PAGE, &prop, 0)) {
            fprintf(stderr, "cuMemCreate failed\n");
            return 1;
        }

    kvc_mapper *m = NULL;
    CHECK_OK(kvc_mapper_create("cuda", text, &m));
    if (!m)
        return 1;
    uintptr_t base = 0;
    CHECK_OK(kvc_mapper_reserve(m, 8 * PAGE, PAGE, &base));
    const uint64_t ids[3] = {1, 2, 3};
    struct counts a, b;

    /* Kept handles off (a daemon that does not offer them; limit 0): every
     * page imported and released, as before the cache. */
    a = now();
    CHECK_OK(map_ids(m, base, 0, ids, 3));
    b = now();
    CHECK(b.import - a.import == 3 && b.release - a.release == 3 && b.map - a.map == 3 &&
          b.access - a.access == 1);
    CHECK(kvc_mapper_kept_total(m) == 0 && kvc_mapper_kept(m, ids, 3) == 0);
    unmap_all(m, base, 0, 3);

    /* Limit 2: three pages imported, two handles kept, the third released
     * after it is mapped (the cache never evicts). */
    kvc_mapper_keep_reset(m, 2);
    a = now();
    CHECK_OK(map_ids(m, base, 0, ids, 3));
    b = now();
    CHECK(b.import - a.import == 3 && b.map - a.map == 3 && b.release - a.release == 1 &&
          b.access - a.access == 1);
    CHECK(kvc_mapper_kept_total(m) == 2 && kvc_mapper_kept(m, ids, 3) == 2);
    const uint64_t one = 1, two = 2, three = 3;
    CHECK(kvc_mapper_kept(m, &one, 1) == 1 && kvc_mapper_kept(m, &two, 1) == 1 &&
          kvc_mapper_kept(m, &three, 1) == 0);
    const char stamp[] = "page one, kept";
    CHECK_OK(kvc_mapper_write(m, base, stamp, sizeof stamp));
    CHECK_OK(kvc_mapper_sync(m));
    unmap_all(m, base, 0, 3);

    /* The pages come back (in another order, elsewhere): 1 and 2 from their
     * kept handles (no import, no release), 3 imported again and released
     * (the cache is full); access set once over the run; the bytes of page
     * 1 are there. */
    const uint64_t back[3] = {3, 1, 2};
    a = now();
    CHECK_OK(map_ids(m, base, 4, back, 3));
    b = now();
    CHECK(b.import - a.import == 1 && b.map - a.map == 3 && b.release - a.release == 1 &&
          b.access - a.access == 1);
    char got[sizeof stamp] = {0};
    CHECK_OK(kvc_mapper_read(m, base + 5 * PAGE, got, sizeof got));
    CHECK(memcmp(got, stamp, sizeof stamp) == 0);
    CHECK(kvc_mapper_kept_total(m) == 2);
    unmap_all(m, base, 4, 3);

    /* DROP: the kept handle of page 1 released (99 is nothing to it). */
    const uint64_t drop[2] = {1, 99};
    a = now();
    CHECK(kvc_mapper_drop(m, drop, 2) == 1);
    b = now();
    CHECK(b.release - a.release == 1);
    CHECK(kvc_mapper_kept_total(m) == 1 && kvc_mapper_kept(m, &one, 1) == 0);
    /* page 1 is imported again (and kept: there is room again) */
    a = now();
    CHECK_OK(map_ids(m, base, 0, &one, 1));
    b = now();
    CHECK(b.import - a.import == 1 && b.release - a.release == 0);
    CHECK(kvc_mapper_kept_total(m) == 2);
    /* a handle may be dropped while its page is mapped: the mapping keeps
     * the page, the bytes stay */
    CHECK(kvc_mapper_drop(m, &one, 1) == 1);
    memset(got, 0, sizeof got);
    CHECK_OK(kvc_mapper_read(m, base, got, sizeof got));
    CHECK(memcmp(got, stamp, sizeof stamp) == 0);
    unmap_all(m, base, 0, 1);

    /* A failed run (the 2nd page's import fails: a closed fd) leaves the
     * cache as it was: page 2 mapped from its kept handle and unmapped
     * again, its handle still kept; page 1 not kept. */
    {
        const uint64_t pair[2] = {2, 1};
        int fds[2] = {export_page(2), open("/dev/null", O_RDONLY | O_CLOEXEC)};
        CHECK(kvc_mapper_map_run_ids(m, base, pair, fds, 2, PAGE) == KVC_ERR_DRIVER);
        CHECK(kvc_mapper_kept_total(m) == 1 && kvc_mapper_kept(m, &two, 1) == 1);
        /* nothing stays mapped: the slots map again */
        CHECK_OK(map_ids(m, base, 0, pair, 2));
        CHECK(kvc_mapper_kept_total(m) == 2);
        unmap_all(m, base, 0, 2);
    }

    /* DROPs racing maps of the same pages (the session's reader answers a
     * DROP while other threads map): every map succeeds. */
    {
        struct race r = {m, base, 0, 0};
        pthread_t t1, t2;
        pthread_create(&t1, NULL, mapper_thread, &r);
        pthread_create(&t2, NULL, dropper_thread, &r);
        pthread_join(t1, NULL);
        pthread_join(t2, NULL);
        CHECK(r.errors == 0);
    }

    /* Reset (session end, resume): every kept handle released; with limit 0
     * nothing is kept any more. */
    size_t left = kvc_mapper_kept_total(m);
    a = now();
    kvc_mapper_keep_reset(m, 0);
    b = now();
    CHECK(b.release - a.release == left);
    CHECK(kvc_mapper_kept_total(m) == 0);
    a = now();
    CHECK_OK(map_ids(m, base, 0, ids, 3));
    b = now();
    CHECK(b.import - a.import == 3 && b.release - a.release == 3 && kvc_mapper_kept_total(m) == 0);
    unmap_all(m, base, 0, 3);

    /* Many pages: the table grows past its first size; destroy releases. */
    kvc_mapper_keep_reset(m, 8192);
    for (int round = 0; round < 40; round++) {
        /* each round keeps 3 more ids (the same 3 pages under new ids:
         * the table only sees ids) */
        uint64_t many[3] = {1000 + 3 * round, 1001 + 3 * round, 1002 + 3 * round};
        int fds[3] = {export_page(1), export_page(2), export_page(3)};
        CHECK_OK(kvc_mapper_map_run_ids(m, base, many, fds, 3, PAGE));
        unmap_all(m, base, 0, 3);
    }
    CHECK(kvc_mapper_kept_total(m) == 120);
    uint64_t some[4] = {1000, 1060, 1119, 5};
    CHECK(kvc_mapper_kept(m, some, 4) == 3);
    CHECK(kvc_mapper_drop(m, some, 4) == 3 && kvc_mapper_kept_total(m) == 117);
    for (int i = 0; i < 120; i++) { /* after the deletions every other id is still found */
        uint64_t id = 1000 + (uint64_t)i;
        int want = id != 1000 && id != 1060 && id != 1119;
        CHECK(kvc_mapper_kept(m, &id, 1) == (size_t)want);
    }
    a = now();
    CHECK_OK(kvc_mapper_release(m, base, 8 * PAGE));
    kvc_mapper_destroy(m);
    b = now();
    CHECK(b.release - a.release == 117);

    /* Every imported handle was released: imports (but the one that
     * failed: the driver counts every call) + pages made = releases. */
    for (int i = 0; i < NPAGES; i++)
        cuMemRelease(made[i]);
    b = now();
    CHECK(b.import - 1 + NPAGES == b.release);
    if (b.import - 1 + NPAGES != b.release)
        fprintf(stderr, "imports %llu, releases %llu\n", (unsigned long long)b.import,
                (unsigned long long)b.release);
    cuDevicePrimaryCtxRelease_v2(dev);
    char rm[700];
    snprintf(rm, sizeof rm, "rm -rf '%s'", tmpl);
    if (system(rm) != 0)
        fprintf(stderr, "could not remove %s\n", tmpl);
    if (failures) {
        printf("keep_cuda: %d failed checks\n", failures);
        return 1;
    }
    printf("keep_cuda: all checks passed\n");
    return 0;
}
