// libkvcached: Regions: a reservation of address space in which page-aligned ranges are mapped with
// daemon pages and unmapped again.
#include "internal.h"

namespace kvc_impl {

// ---- regions ----------------------------------------------------------

kvc_status region_new(kvc_session *s, uint64_t max_bytes, kvc_region **out)
{
    if (s->life.ended.load())
        return s->ended_error();
    uint64_t size = kvc_round_up(max_bytes, s->page_size);
    if (max_bytes == 0 || size == 0)
        return kvc_fail(KVC_ERR_INVALID_ARGUMENT, "region size %llu: must be 1..2^64-page",
                        (unsigned long long)max_bytes);
    uint64_t npages = size / s->page_size;
    if (npages > (1ull << 32))
        return kvc_fail(KVC_ERR_NO_MEMORY, "region of %llu bytes is beyond any address space",
                        (unsigned long long)size);
    auto r = std::make_unique<kvc_region>();
    r->session = s;
    r->size = size;
    r->requested = max_bytes;
    r->page = s->page_size;
    kvc_status st = kvc_mapper_reserve(s->mapper, size, s->page_size, &r->base);
    if (st != KVC_OK)
        return st;
    try {
        r->ids.assign(npages, 0);
        r->mapped.assign(npages, 0);
    } catch (...) {
        kvc_mapper_release(s->mapper, r->base, r->size);
        return kvc_fail(KVC_ERR_NO_MEMORY, "no memory for the books of %llu pages",
                        (unsigned long long)npages);
    }
    {
        std::lock_guard<std::mutex> g(s->books.mu);
        s->books.regions++;
    }
    *out = r.release();
    return KVC_OK;
}

// Map a sorted, unique list of unmapped slots with one allocation.
kvc_status region_map_slots(kvc_region *r, const std::vector<uint64_t> &slots)
{
    if (slots.empty())
        return KVC_OK;
    kvc_session *s = r->session;
    std::vector<uint64_t> ids;
    std::vector<int> fds;
    kvc_status st = session_allocate(s, slots.size(), ids, fds);
    if (st != KVC_OK)
        return st;
    // each run of consecutive slots in one call (on CUDA: one cuMemSetAccess per run)
    for (size_t i = 0, j = 0; i < slots.size(); i = j) {
        for (j = i + 1; j < slots.size() && slots[j] == slots[j - 1] + 1; j++) {
        }
        // (by id: a page whose handle the session kept is mapped from it)
        st = kvc_mapper_map_run_ids(s->mapper, r->base + slots[i] * r->page, &ids[i], &fds[i], j - i,
                                    r->page);
        if (st != KVC_OK) {
            std::string msg = kvc_last_error();
            for (size_t k = j; k < fds.size(); k++)
                close(fds[k]);
            for (size_t k = 0; k < i; k++)
                kvc_mapper_unmap(s->mapper, r->base + slots[k] * r->page, r->page);
            session_free_ids(s, ids);
            return kvc_fail(st, "%s", msg.c_str());
        }
    }
    for (size_t i = 0; i < slots.size(); i++) {
        r->ids[slots[i]] = ids[i];
        r->mapped[slots[i]] = kSlotMapped;
    }
    r->mapped_pages += slots.size();
    return KVC_OK;
}

kvc_status region_unmap_slots(kvc_region *r, const std::vector<uint64_t> &slots)
{
    kvc_session *s = r->session;
    std::vector<uint64_t> ids;
    kvc_status first = KVC_OK;
    std::string msg;
    for (uint64_t k : slots) {
        if (!r->mapped[k])
            continue;
        kvc_status st = kvc_mapper_unmap(s->mapper, r->base + k * r->page, r->page);
        if (st != KVC_OK) {
            if (first == KVC_OK) {
                first = st;
                msg = kvc_last_error();
            }
            continue;  // still mapped: keep it on the books
        }
        const uint8_t was = r->mapped[k];
        r->mapped[k] = kSlotFree;
        r->mapped_pages--;
        if (was == kSlotLocal)
            r->local_pages--;
        else if (was == kSlotMapped)
            ids.push_back(r->ids[k]);
    }
    kvc_status st = session_free_ids(s, ids);
    // After the session ended the daemon took its pages back: unmapping is
    // local only (regions of an ended session can still be unmapped and
    // destroyed).
    if (st != KVC_OK && s->life.ended.load())
        st = KVC_OK;
    if (first != KVC_OK)
        return kvc_fail(first, "%s", msg.c_str());
    return st;
}

kvc_status check_ranges(const kvc_region *r, const kvc_range *ranges, size_t n)
{
    if (n && !ranges)
        return kvc_fail(KVC_ERR_INVALID_ARGUMENT, "ranges is NULL");
    for (size_t i = 0; i < n; i++) {
        uint64_t f = 0, e = 0;
        if (kvc_pages_covering(ranges[i].offset, ranges[i].size, r->size, r->page, &f, &e) != 0)
            return kvc_fail(KVC_ERR_INVALID_ARGUMENT,
                            "range %zu [%llu, +%llu) lies outside the region's %llu bytes", i,
                            (unsigned long long)ranges[i].offset,
                            (unsigned long long)ranges[i].size, (unsigned long long)r->size);
    }
    return KVC_OK;
}

// The unmapped slots of the pages covering the ranges, sorted and unique.
// r->mu held.
static std::vector<uint64_t> unmapped_slots(const kvc_region *r, const kvc_range *ranges, size_t n)
{
    std::vector<uint64_t> slots;
    for (size_t i = 0; i < n; i++) {
        uint64_t f = 0, e = 0;
        kvc_pages_covering(ranges[i].offset, ranges[i].size, r->size, r->page, &f, &e);
        for (uint64_t k = f; k < e; k++)
            if (!r->mapped[k])
                slots.push_back(k);
    }
    std::sort(slots.begin(), slots.end());
    slots.erase(std::unique(slots.begin(), slots.end()), slots.end());
    return slots;
}

kvc_status region_map_ranges(kvc_region *r, const kvc_range *ranges, size_t n)
{
    kvc_status st = check_ranges(r, ranges, n);
    if (st != KVC_OK)
        return st;
    std::lock_guard<std::mutex> g(r->mu);
    return region_map_slots(r, unmapped_slots(r, ranges, n));
}

// Local pages: the process's own memory, no daemon asked (all or nothing).
kvc_status region_map_ranges_local(kvc_region *r, const kvc_range *ranges, size_t n)
{
    kvc_status st = check_ranges(r, ranges, n);
    if (st != KVC_OK)
        return st;
    std::lock_guard<std::mutex> g(r->mu);
    kvc_mapper *m = r->session->mapper;
    std::vector<uint64_t> slots = unmapped_slots(r, ranges, n);
    for (size_t i = 0; i < slots.size(); i++) {
        st = kvc_mapper_map_local(m, r->base + slots[i] * r->page, r->page);
        if (st != KVC_OK) {
            std::string msg = kvc_last_error();
            for (size_t j = 0; j < i; j++)
                kvc_mapper_unmap(m, r->base + slots[j] * r->page, r->page);
            return kvc_fail(st, "%s", msg.c_str());
        }
    }
    for (uint64_t k : slots) {
        r->ids[k] = 0;
        r->mapped[k] = kSlotLocal;
    }
    r->mapped_pages += slots.size();
    r->local_pages += slots.size();
    return KVC_OK;
}

kvc_status region_unmap_ranges(kvc_region *r, const kvc_range *ranges, size_t n, bool only_local)
{
    kvc_status st = check_ranges(r, ranges, n);
    if (st != KVC_OK)
        return st;
    std::lock_guard<std::mutex> g(r->mu);
    std::vector<uint64_t> slots;
    for (size_t i = 0; i < n; i++) {
        uint64_t f = 0, e = 0;
        // A range that runs to the region's end (as requested, or as
        // reserved) releases its last page: the bytes past the requested
        // size are the region's own padding, not anyone's data.
        uint64_t size = ranges[i].size;
        if (size > 0 && ranges[i].offset + size >= r->requested)
            size = r->size - ranges[i].offset;
        kvc_pages_inside(ranges[i].offset, size, r->size, r->page, &f, &e);
        for (uint64_t k = f; k < e; k++)
            if (only_local ? r->mapped[k] == kSlotLocal : r->mapped[k] != kSlotFree)
                slots.push_back(k);
    }
    std::sort(slots.begin(), slots.end());
    slots.erase(std::unique(slots.begin(), slots.end()), slots.end());
    return region_unmap_slots(r, slots);
}

void region_delete(kvc_region *r)
{
    kvc_session *s = r->session;
    {
        std::lock_guard<std::mutex> g(r->mu);
        std::vector<uint64_t> all;
        for (uint64_t k = 0; k < r->mapped.size(); k++)
            if (r->mapped[k])
                all.push_back(k);
        region_unmap_slots(r, all);
        kvc_mapper_release(s->mapper, r->base, r->size);
    }
    {
        std::lock_guard<std::mutex> g(s->books.mu);
        s->books.regions--;
    }
    delete r;
}

}  // namespace kvc_impl
