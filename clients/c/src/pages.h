/* Region arithmetic: which pages a byte range covers. Header-only C,
 * internal to libkvcached, unit-tested in tests/test_pages.c. */
#ifndef KVC_PAGES_H
#define KVC_PAGES_H

#include <stdint.h>

/* Pages [*first, *end) that cover every byte of [offset, offset+size)
 * (widened outward). Returns 0, or -1 if the range does not lie inside a
 * region of region_size bytes (or overflows). size 0 gives an empty span. */
static inline int kvc_pages_covering(uint64_t offset, uint64_t size, uint64_t region_size,
                                     uint64_t page, uint64_t *first, uint64_t *end)
{
    if (page == 0 || offset > region_size || size > region_size - offset)
        return -1;
    if (size == 0) {
        *first = *end = offset / page;
        return 0;
    }
    *first = offset / page;
    *end = (offset + size + page - 1) / page;
    return 0;
}

/* Pages [*first, *end) lying wholly inside [offset, offset+size) (narrowed
 * inward; possibly empty). Same validation as kvc_pages_covering. */
static inline int kvc_pages_inside(uint64_t offset, uint64_t size, uint64_t region_size,
                                   uint64_t page, uint64_t *first, uint64_t *end)
{
    if (page == 0 || offset > region_size || size > region_size - offset)
        return -1;
    uint64_t f = (offset + page - 1) / page;
    uint64_t e = (offset + size) / page;
    if (e < f)
        e = f;
    *first = f;
    *end = e;
    return 0;
}

/* Round up to a multiple of page; 0 on overflow (or page 0). */
static inline uint64_t kvc_round_up(uint64_t value, uint64_t page)
{
    if (page == 0)
        return 0;
    uint64_t r = value % page;
    if (r == 0)
        return value;
    if (value > UINT64_MAX - (page - r))
        return 0;
    return value + (page - r);
}

#endif
