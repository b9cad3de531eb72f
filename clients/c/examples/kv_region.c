/* kv_region: reserve one region for a model's whole KV cache, the way a
 * llama.cpp KV buffer would use it, then grow and trim what is mapped.
 *
 *   kvc_kv_region [--socket PATH] [--layers 32] [--kv-heads 8]
 *                 [--head-dim 128] [--ctx 8192] [--type-size 2]
 *
 * Each layer has a K and a V tensor of [kv_heads*head_dim, ctx] elements
 * (one cell = kv_heads*head_dim*type_size bytes), placed at page-aligned
 * offsets. Cells [0, n_kv) of every tensor are mapped for a few n_kv. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvcached.h"

#define MiB (1024.0 * 1024.0)

static int check(kvc_status st, const char *what)
{
    if (st != KVC_OK) {
        fprintf(stderr, "%s: %s: %s\n", what, kvc_status_to_string(st), kvc_last_error());
        return 0;
    }
    return 1;
}

static uint64_t arg_u64(int argc, char **argv, const char *name, uint64_t def)
{
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], name) == 0)
            return strtoull(argv[i + 1], NULL, 0);
    return def;
}

static const char *arg_str(int argc, char **argv, const char *name)
{
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], name) == 0)
            return argv[i + 1];
    return NULL;
}

/* Map (or trim to) cells [0, n_kv) of every tensor: one call, one Allocate. */
static int set_cells(kvc_region *r, const uint64_t *offs, size_t n, uint64_t row, uint64_t ctx,
                     uint64_t n_kv)
{
    kvc_range *ranges = calloc(n, sizeof *ranges);
    if (!ranges)
        return 0;
    for (size_t i = 0; i < n; i++) {
        ranges[i].offset = offs[i] + n_kv * row;
        ranges[i].size = (ctx - n_kv) * row;
    }
    /* Trim what lies past n_kv (whole pages only), then map the prefixes. */
    int ok = check(kvc_region_unmap_ranges(r, ranges, n), "unmap");
    for (size_t i = 0; i < n; i++) {
        ranges[i].offset = offs[i];
        ranges[i].size = n_kv * row;
    }
    ok = ok && check(kvc_region_map_ranges(r, ranges, n), "map");
    free(ranges);
    return ok;
}

int main(int argc, char **argv)
{
    uint64_t layers = arg_u64(argc, argv, "--layers", 32);
    uint64_t heads = arg_u64(argc, argv, "--kv-heads", 8);
    uint64_t head_dim = arg_u64(argc, argv, "--head-dim", 128);
    uint64_t ctx = arg_u64(argc, argv, "--ctx", 8192);
    uint64_t type_size = arg_u64(argc, argv, "--type-size", 2);
    const char *socket = arg_str(argc, argv, "--socket");
    if (!layers || !heads || !head_dim || !ctx || !type_size) {
        fprintf(stderr, "all sizes must be positive\n");
        return 2;
    }

    kvc_client *client = NULL;
    kvc_session *session = NULL;
    kvc_region *region = NULL;
    uint64_t *sizes = NULL, *offs = NULL;
    int rc = 1;
    if (!check(kvc_client_create(socket, &client), "connect"))
        return 1;
    printf("daemon %s, backend %s\n", kvc_client_daemon_version(client),
           kvc_client_backend(client));

    kvc_session_options opt;
    kvc_session_options_init(&opt);
    opt.name = "kv_region example";
    kvc_label label = {"example", "kv_region"};
    opt.labels = &label;
    opt.num_labels = 1;
    if (!check(kvc_session_open(client, &opt, &session), "open session"))
        goto out;
    uint64_t page = kvc_session_page_size(session);
    uint64_t row = heads * head_dim * type_size;
    size_t n = (size_t)(2 * layers);
    sizes = calloc(n, sizeof *sizes);
    offs = calloc(n, sizeof *offs);
    if (!sizes || !offs)
        goto out;
    for (size_t i = 0; i < n; i++)
        sizes[i] = row * ctx;
    uint64_t total = 0;
    if (!check(kvc_layout_page_aligned(page, sizes, n, offs, &total), "layout"))
        goto out;
    printf("session %" PRIu64 " on %s (%s), page %.1f MiB\n", kvc_session_id(session),
           kvc_session_device(session), kvc_session_kind(session), page / MiB);
    printf("model: %" PRIu64 " layers x K,V of [%" PRIu64 " x %" PRIu64 "] x %" PRIu64
           " B = %.1f MiB logical, %.1f MiB reserved\n",
           layers, heads * head_dim, ctx, type_size, (double)row * ctx * n / MiB, total / MiB);
    if (!check(kvc_region_create(session, total, &region), "reserve"))
        goto out;

    uint64_t steps[] = {256, 1024, ctx / 2, ctx, 256, 0};
    for (size_t s = 0; s < sizeof steps / sizeof steps[0]; s++) {
        uint64_t n_kv = steps[s] > ctx ? ctx : steps[s];
        if (!set_cells(region, offs, n, row, ctx, n_kv))
            goto out;
        printf("n_kv %6" PRIu64 ": mapped %8.1f MiB of %8.1f MiB (session holds %.1f MiB)\n",
               n_kv, kvc_region_mapped_bytes(region) / MiB, kvc_region_size(region) / MiB,
               kvc_session_held_bytes(session) / MiB);
        if (n_kv) {
            /* What a graph would do: write cell n_kv-1 of the last V tensor. */
            uint64_t at = offs[n - 1] + (n_kv - 1) * row;
            const char msg[] = "kv";
            char back[sizeof msg] = {0};
            if (!check(kvc_region_write(region, at, msg, sizeof msg), "write") ||
                !check(kvc_region_read(region, at, back, sizeof back), "read"))
                goto out;
            if (memcmp(msg, back, sizeof msg) != 0) {
                fprintf(stderr, "read back differs\n");
                goto out;
            }
        }
    }
    kvc_stats st;
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    if (!check(kvc_session_get_stats(session, &st), "stats"))
        goto out;
    printf("daemon: session holds %" PRIu64 " pages; device in use %.1f MiB of budget %.1f MiB\n",
           st.pages_held, st.device.in_use_bytes / MiB, st.device.budget_bytes / MiB);
    rc = 0;
out:
    kvc_region_destroy(region);
    if (session)
        check(kvc_session_close(session), "close session");
    kvc_client_destroy(client);
    free(sizes);
    free(offs);
    return rc;
}
