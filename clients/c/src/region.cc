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

// Unmap the slots (sorted, unique, every one mapped: daemon, standby,
// orphan or local pages alike, each a whole mapping) by runs: each run of
// adjacent slots with one mapper call over the run (on CUDA one cuMemUnmap
// over the run's mappings); a run the mapper refuses is unmapped page by
// page. The slots unmapped are appended to `done`, in order; a slot whose
// unmap failed is still mapped. Returns the first page's error. No books
// are touched: the caller's job.
static kvc_status unmap_runs(kvc_region *r, const std::vector<uint64_t> &slots,
                             std::vector<uint64_t> &done)
{
    kvc_mapper *m = r->session->mapper;
    kvc_status first = KVC_OK;
    std::string msg;
    done.reserve(done.size() + slots.size());
    for (size_t i = 0, j = 0; i < slots.size(); i = j) {
        for (j = i + 1; j < slots.size() && slots[j] == slots[j - 1] + 1; j++) {
        }
        if (j - i > 1 &&
            kvc_mapper_unmap(m, r->base + slots[i] * r->page, (j - i) * r->page) == KVC_OK) {
            done.insert(done.end(), slots.begin() + i, slots.begin() + j);
            continue;
        }
        for (size_t k = i; k < j; k++) {  // one page, or a run refused: page by page
            kvc_status st = kvc_mapper_unmap(m, r->base + slots[k] * r->page, r->page);
            if (st != KVC_OK) {
                if (first == KVC_OK) {
                    first = st;
                    msg = kvc_last_error();
                }
                continue;
            }
            done.push_back(slots[k]);
        }
    }
    if (first != KVC_OK)
        return kvc_fail(first, "%s", msg.c_str());
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
            // Roll back the earlier runs (by runs). A page that cannot be
            // unmapped stays mapped and on the books, not freed.
            std::vector<uint64_t> done, give;
            unmap_runs(r, std::vector<uint64_t>(slots.begin(), slots.begin() + i), done);
            for (size_t k = 0, d = 0; k < slots.size(); k++) {
                if (k < i && !(d < done.size() && done[d] == slots[k])) {
                    r->ids[slots[k]] = ids[k];
                    r->mapped[slots[k]] = kSlotMapped;
                    r->mapped_pages++;
                    continue;
                }
                d += k < i;
                give.push_back(ids[k]);
            }
            session_free_ids(s, give);
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

// Unmap the slots in use (free ones skipped) and give the daemon's pages
// among them back in one Free. Each run of adjacent slots is unmapped with
// one mapper call (unmap_runs); a page whose unmap fails stays mapped and
// on the books (not freed); the first error is returned.
kvc_status region_unmap_slots(kvc_region *r, const std::vector<uint64_t> &slots)
{
    kvc_session *s = r->session;
    std::vector<uint64_t> live, done, ids;
    live.reserve(slots.size());
    for (uint64_t k : slots)
        if (r->mapped[k] != kSlotFree)
            live.push_back(k);
    const std::vector<uint64_t> order = live;  // the caller's (release_standby: standby first)
    std::sort(live.begin(), live.end());
    live.erase(std::unique(live.begin(), live.end()), live.end());
    const kvc_status first = unmap_runs(r, live, done);  // done: sorted, as live
    const std::string msg = first != KVC_OK ? kvc_last_error() : "";
    ids.reserve(done.size());
    // the books, and the one Free, in the caller's order
    for (uint64_t k : order) {
        if (r->mapped[k] == kSlotFree || !std::binary_search(done.begin(), done.end(), k))
            continue;  // named twice, or still mapped
        const uint8_t was = r->mapped[k];
        r->mapped[k] = kSlotFree;
        r->mapped_pages--;
        if (was == kSlotLocal)
            r->local_pages--;
        else if (was == kSlotMapped || was == kSlotStandby)
            ids.push_back(r->ids[k]);  // a standby page is given back as any page
        if (was == kSlotStandby)
            r->standby_pages--;
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

// The slots of the pages covering the ranges that are not in use, sorted
// and unique: `fresh` unmapped, `back` standby (mapped, to be taken back).
// r->mu held.
static void slots_to_map(const kvc_region *r, const kvc_range *ranges, size_t n,
                         std::vector<uint64_t> &fresh, std::vector<uint64_t> &back)
{
    for (size_t i = 0; i < n; i++) {
        uint64_t f = 0, e = 0;
        kvc_pages_covering(ranges[i].offset, ranges[i].size, r->size, r->page, &f, &e);
        for (uint64_t k = f; k < e; k++) {
            if (r->mapped[k] == kSlotFree)
                fresh.push_back(k);
            else if (r->mapped[k] == kSlotStandby)
                back.push_back(k);
        }
    }
    for (auto *v : {&fresh, &back}) {
        std::sort(v->begin(), v->end());
        v->erase(std::unique(v->begin(), v->end()), v->end());
    }
}

// Standby slots in use again: no Allocate, no driver call (they stayed
// mapped); one USE record tells the daemon, not waited for. r->mu held.
static void take_back_standby(kvc_region *r, const std::vector<uint64_t> &slots)
{
    if (slots.empty())
        return;
    std::vector<uint64_t> ids;
    ids.reserve(slots.size());
    for (uint64_t k : slots) {
        r->mapped[k] = kSlotMapped;
        ids.push_back(r->ids[k]);
    }
    r->standby_pages -= slots.size();
    session_use_nowait(r->session, ids);
}

kvc_status region_map_ranges(kvc_region *r, const kvc_range *ranges, size_t n)
{
    kvc_status st = check_ranges(r, ranges, n);
    if (st != KVC_OK)
        return st;
    std::lock_guard<std::mutex> g(r->mu);
    std::vector<uint64_t> fresh, back;
    slots_to_map(r, ranges, n, fresh, back);
    st = region_map_slots(r, fresh);  // all or nothing: standby slots stay standby on failure
    if (st != KVC_OK)
        return st;
    take_back_standby(r, back);
    return KVC_OK;
}

// Local pages: the process's own memory, no daemon asked (all or nothing).
kvc_status region_map_ranges_local(kvc_region *r, const kvc_range *ranges, size_t n)
{
    kvc_status st = check_ranges(r, ranges, n);
    if (st != KVC_OK)
        return st;
    std::lock_guard<std::mutex> g(r->mu);
    kvc_mapper *m = r->session->mapper;
    std::vector<uint64_t> slots, back;
    slots_to_map(r, ranges, n, slots, back);  // standby slots: the daemon's pages, taken back
    for (size_t i = 0; i < slots.size(); i++) {
        st = kvc_mapper_map_local(m, r->base + slots[i] * r->page, r->page);
        if (st != KVC_OK) {
            std::string msg = kvc_last_error();
            // Roll back by runs; a page that cannot be unmapped stays a
            // local page on the books.
            std::vector<uint64_t> done;
            unmap_runs(r, std::vector<uint64_t>(slots.begin(), slots.begin() + i), done);
            for (size_t j = 0, d = 0; j < i; j++) {
                if (d < done.size() && done[d] == slots[j]) {
                    d++;
                    continue;
                }
                r->ids[slots[j]] = 0;
                r->mapped[slots[j]] = kSlotLocal;
                r->mapped_pages++;
                r->local_pages++;
            }
            return kvc_fail(st, "%s", msg.c_str());
        }
    }
    for (uint64_t k : slots) {
        r->ids[k] = 0;
        r->mapped[k] = kSlotLocal;
    }
    r->mapped_pages += slots.size();
    r->local_pages += slots.size();
    take_back_standby(r, back);
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

// The in-use daemon pages lying wholly inside the ranges (as
// region_unmap_ranges narrows them), per range in offset order, and every
// other slot in use there (local and orphan pages). r->mu held.
static void slots_inside(const kvc_region *r, const kvc_range *ranges, size_t n,
                         std::vector<std::vector<uint64_t>> &daemon_pages,
                         std::vector<uint64_t> &others)
{
    daemon_pages.assign(n, {});
    for (size_t i = 0; i < n; i++) {
        uint64_t f = 0, e = 0;
        uint64_t size = ranges[i].size;
        if (size > 0 && ranges[i].offset + size >= r->requested)
            size = r->size - ranges[i].offset;
        kvc_pages_inside(ranges[i].offset, size, r->size, r->page, &f, &e);
        for (uint64_t k = f; k < e; k++) {
            if (r->mapped[k] == kSlotMapped)
                daemon_pages[i].push_back(k);
            else if (r->mapped[k] == kSlotLocal || r->mapped[k] == kSlotOrphan)
                others.push_back(k);
        }
    }
}

// Unmap as standby (docs/protocol.md "Standby pages"): the daemon pages in
// the ranges stay mapped and the session's, up to the region's standby
// limit, picked from the front of every range in turn (the pages a range
// that grows again needs first); sent as FREE records with the standby
// flag. Every other page in the ranges is unmapped and freed as
// region_unmap_ranges does; so is everything where the daemon does not
// offer standby, the limit is 0, or the session is not live.
kvc_status region_unmap_ranges_standby(kvc_region *r, const kvc_range *ranges, size_t n)
{
    kvc_status st = check_ranges(r, ranges, n);
    if (st != KVC_OK)
        return st;
    std::lock_guard<std::mutex> g(r->mu);
    kvc_session *s = r->session;
    const uint64_t cap = r->standby_limit.load() / r->page;
    uint64_t room = cap > r->standby_pages.load() ? cap - r->standby_pages.load() : 0;
    if (!s->standby_ok.load() || s->life.ended.load() || s->resuming())
        room = 0;
    std::vector<std::vector<uint64_t>> per;
    std::vector<uint64_t> rest;
    slots_inside(r, ranges, n, per, rest);
    std::vector<uint64_t> picked;
    std::vector<uint8_t> taken(room ? r->mapped.size() : 0, 0);
    for (size_t depth = 0, left = 1; room && left; depth++) {
        left = 0;
        for (size_t i = 0; i < n && picked.size() < room; i++) {
            if (depth >= per[i].size())
                continue;
            left = 1;
            uint64_t k = per[i][depth];
            if (!taken[k]) {
                taken[k] = 1;
                picked.push_back(k);
            }
        }
        if (picked.size() >= room)
            break;
    }
    for (auto &v : per)
        for (uint64_t k : v)
            if (taken.empty() || !taken[k])
                rest.push_back(k);
    if (!picked.empty()) {
        std::vector<uint64_t> ids;
        ids.reserve(picked.size());
        for (uint64_t k : picked)
            ids.push_back(r->ids[k]);
        size_t done = 0;
        session_standby_ids(s, ids, &done);  // what the daemon did not take is freed below
        for (size_t i = 0; i < picked.size(); i++) {
            if (i < done)
                r->mapped[picked[i]] = kSlotStandby;
            else
                rest.push_back(picked[i]);
        }
        r->standby_pages += done;
    }
    std::sort(rest.begin(), rest.end());
    rest.erase(std::unique(rest.begin(), rest.end()), rest.end());
    return region_unmap_slots(r, rest);
}

// Unmap and free up to `want` standby pages, the highest slots first;
// *released (may be NULL) gets the bytes given back. r->mu held.
static kvc_status release_standby_locked(kvc_region *r, uint64_t want, uint64_t *released)
{
    std::vector<uint64_t> slots;
    for (uint64_t k = r->mapped.size(); k-- > 0 && slots.size() < want;)
        if (r->mapped[k] == kSlotStandby)
            slots.push_back(k);
    std::sort(slots.begin(), slots.end());
    const uint64_t before = r->standby_pages.load();
    kvc_status st = region_unmap_slots(r, slots);
    if (released)
        *released = (before - r->standby_pages.load()) * r->page;
    return st;
}

kvc_status region_release_standby(kvc_region *r, uint64_t bytes, uint64_t *released)
{
    std::lock_guard<std::mutex> g(r->mu);
    uint64_t want = bytes / r->page + (bytes % r->page != 0);
    return release_standby_locked(r, want, released);
}

kvc_status region_set_standby_limit(kvc_region *r, uint64_t bytes)
{
    std::lock_guard<std::mutex> g(r->mu);
    r->standby_limit = bytes;
    const uint64_t cap = bytes / r->page;
    if (r->standby_pages.load() <= cap)
        return KVC_OK;
    return release_standby_locked(r, r->standby_pages.load() - cap, nullptr);
}

// The region's session ended (kvc_region_rebind): its standby pages are
// unmapped here (no daemon counts them; the caller sees them unmapped
// already). r->mu held.
void region_orphan_standby_locked(kvc_region *r)
{
    std::vector<uint64_t> standby, done;
    for (uint64_t k = 0; k < r->mapped.size(); k++)
        if (r->mapped[k] == kSlotStandby)
            standby.push_back(k);
    unmap_runs(r, standby, done);  // by runs; a page that fails stays standby
    for (uint64_t k : done) {
        r->mapped[k] = kSlotFree;
        r->ids[k] = 0;
        r->mapped_pages--;
        r->standby_pages--;
    }
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
