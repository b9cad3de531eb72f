/* Region arithmetic (src/pages.h) and the public layout helper. */
#include <stdio.h>

#include "kvcached.h"
#include "pages.h"

static int failures;
#define CHECK(cond)                                                            \
    do {                                                                       \
        if (!(cond)) {                                                         \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            failures++;                                                        \
        }                                                                      \
    } while (0)

#define P 2097152ull

int main(void)
{
    uint64_t f, e;
    /* covering widens outward */
    CHECK(kvc_pages_covering(0, 1, 4 * P, P, &f, &e) == 0 && f == 0 && e == 1);
    CHECK(kvc_pages_covering(P - 1, 2, 4 * P, P, &f, &e) == 0 && f == 0 && e == 2);
    CHECK(kvc_pages_covering(P, P, 4 * P, P, &f, &e) == 0 && f == 1 && e == 2);
    CHECK(kvc_pages_covering(0, 4 * P, 4 * P, P, &f, &e) == 0 && f == 0 && e == 4);
    CHECK(kvc_pages_covering(3 * P, 0, 4 * P, P, &f, &e) == 0 && f == e);
    CHECK(kvc_pages_covering(4 * P, 0, 4 * P, P, &f, &e) == 0 && f == e);
    /* outside / overflow */
    CHECK(kvc_pages_covering(0, 4 * P + 1, 4 * P, P, &f, &e) == -1);
    CHECK(kvc_pages_covering(4 * P + 1, 0, 4 * P, P, &f, &e) == -1);
    CHECK(kvc_pages_covering(2 * P, UINT64_MAX, 4 * P, P, &f, &e) == -1);
    CHECK(kvc_pages_covering(UINT64_MAX, 1, 4 * P, P, &f, &e) == -1);
    CHECK(kvc_pages_covering(0, 1, 4 * P, 0, &f, &e) == -1);
    /* inside narrows inward: never a byte outside the range */
    CHECK(kvc_pages_inside(0, 4 * P, 4 * P, P, &f, &e) == 0 && f == 0 && e == 4);
    CHECK(kvc_pages_inside(1, 4 * P - 1, 4 * P, P, &f, &e) == 0 && f == 1 && e == 4);
    CHECK(kvc_pages_inside(1, 2 * P - 2, 4 * P, P, &f, &e) == 0 && f == e);
    CHECK(kvc_pages_inside(P / 2, P, 4 * P, P, &f, &e) == 0 && f == e);
    CHECK(kvc_pages_inside(P, P, 4 * P, P, &f, &e) == 0 && f == 1 && e == 2);
    CHECK(kvc_pages_inside(0, 5 * P, 4 * P, P, &f, &e) == -1);
    /* rounding */
    CHECK(kvc_round_up(0, P) == 0);
    CHECK(kvc_round_up(1, P) == P);
    CHECK(kvc_round_up(P, P) == P);
    CHECK(kvc_round_up(UINT64_MAX, P) == 0);
    CHECK(kvc_round_up(5, 0) == 0);

    /* layout: tensors at page-aligned offsets */
    uint64_t sizes[4] = {1, P, P + 1, 0}, offs[4], total = 0;
    CHECK(kvc_layout_page_aligned(P, sizes, 4, offs, &total) == KVC_OK);
    CHECK(offs[0] == 0 && offs[1] == P && offs[2] == 2 * P && offs[3] == 4 * P && total == 4 * P);
    uint64_t huge[2] = {UINT64_MAX - 5, P};
    CHECK(kvc_layout_page_aligned(P, huge, 2, offs, &total) == KVC_ERR_INVALID_ARGUMENT);
    CHECK(kvc_layout_page_aligned(0, sizes, 4, offs, &total) == KVC_ERR_INVALID_ARGUMENT);
    CHECK(kvc_last_error()[0] != 0);

    if (failures) {
        printf("0 passed, %d failed\n", failures);
        return 1;
    }
    printf("pages: all checks passed\n");
    return 0;
}
