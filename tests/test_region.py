"""Region: reserve once, map and unmap any page-aligned range, one Allocate
per map call, data that survives other ranges changing."""

from __future__ import annotations

import pytest

from kvtest import assert_books
from kvcached_service import errors

MiB = 1 << 20


def test_prefix_growth_and_trim(daemon):
    with daemon.client() as c, c.open_session("r") as s, s.region(64 * MiB) as r:
        assert r.mapped_bytes == 0
        r.grow_to(5 * MiB)  # rounds up to 3 pages
        assert r.mapped_pages == 3 and r.mapped_ranges() == [(0, 6 * MiB)]
        r.write(0, b"head")
        r.write(6 * MiB - 4, b"tail")
        before = s.my_stats().allocations_total
        r.grow_to(20 * MiB)
        assert s.my_stats().allocations_total == before + 1
        assert r.read(0, 4) == b"head" and r.read(6 * MiB - 4, 4) == b"tail"
        assert r.read(10 * MiB, 16) == bytes(16)
        r.trim_to(4 * MiB)
        assert r.mapped_ranges() == [(0, 4 * MiB)]
        assert s.my_stats().pages_held == 2
        assert r.read(0, 4) == b"head"
        with pytest.raises(errors.FailedPrecondition, match="not mapped"):
            r.read(5 * MiB, 1)
        assert_books(s.stats())


def test_many_tensor_prefixes_in_one_allocate(daemon):
    """llama.cpp layout: every layer's K and V at a page-aligned offset; map
    the prefix [0, n_kv) of each with one Allocate."""
    layers, tensor = 4, 8 * MiB
    with daemon.client() as c, c.open_session("kv") as s, s.region(2 * layers * tensor) as r:
        offsets = [i * tensor for i in range(2 * layers)]
        before = s.my_stats().allocations_total
        r.map_ranges([(off, 3 * MiB) for off in offsets])  # 2 pages each
        assert s.my_stats().allocations_total == before + 1
        assert r.mapped_pages == 2 * 2 * layers
        for i, off in enumerate(offsets):
            r.write(off, bytes([i + 1]) * 64)
        r.map_ranges([(off, 5 * MiB) for off in offsets])  # grow each prefix to 3 pages
        assert r.mapped_pages == 3 * 2 * layers
        for i, off in enumerate(offsets):
            assert r.read(off, 64) == bytes([i + 1]) * 64
        # trim every tensor back to one page, in one Free each
        for off in offsets:
            r.unmap(off + 2 * MiB, 4 * MiB)
        assert r.mapped_pages == 2 * layers
        assert s.my_stats().pages_held == 2 * layers


def test_unmap_middle_and_remap_reads_zero(daemon):
    with daemon.client() as c, c.open_session("r") as s, s.region(16 * MiB) as r:
        r.map(0, 16 * MiB)
        r.write(4 * MiB, b"x" * 100)
        r.unmap(4 * MiB, 2 * MiB)
        assert r.mapped_ranges() == [(0, 4 * MiB), (6 * MiB, 10 * MiB)]
        r.map(4 * MiB, 2 * MiB)
        assert r.read(4 * MiB, 100) == bytes(100), "a page given back and re-mapped must read as zeros"


def test_bad_ranges(daemon):
    with daemon.client() as c, c.open_session("r") as s, s.region(8 * MiB) as r:
        with pytest.raises(errors.InvalidArgument, match="not a multiple of the page size"):
            r.map(MiB, MiB)
        with pytest.raises(errors.InvalidArgument, match="outside the region"):
            r.map(6 * MiB, 4 * MiB)
        with pytest.raises(errors.InvalidArgument, match="negative"):
            r.map(0, -1)
        with pytest.raises(errors.InvalidArgument, match="not a multiple of the page size"):
            r.unmap(0, MiB)
        assert r.mapped_pages == 0 and s.my_stats().pages_held == 0


def test_range_to_the_region_end_releases_its_last_page(daemon):
    """A region whose size is not whole pages: a range that runs to its end
    (as created) releases the last, partly padded page; every page can be
    given back."""
    with daemon.client() as c, c.open_session("r") as s, s.region(5 * MiB) as r:  # 3 pages of 2 MiB
        assert r.size == 6 * MiB
        r.map(0, 5 * MiB)
        assert r.mapped_pages == 3
        assert r.unmap(2 * MiB, 3 * MiB) == 2  # [2, 5) MiB: pages 1 and 2
        assert r.mapped_ranges() == [(0, 2 * MiB)]
        r.map(0, 5 * MiB)
        assert r.unmap(4 * MiB, MiB) == 1  # the last page alone
        assert r.unmap(0, 5 * MiB) == 2
        assert r.mapped_pages == 0 and s.my_stats().pages_held == 0
        with pytest.raises(errors.InvalidArgument, match="not a multiple of the page size"):
            r.unmap(2 * MiB, MiB)  # ends inside the region: still refused
        assert_books(s.stats())


def test_region_close_gives_everything_back(daemon):
    with daemon.client() as c, c.open_session("r") as s:
        r = s.region(32 * MiB)
        r.map(0, 32 * MiB)
        assert s.my_stats().pages_held == 16
        r.close()
        assert s.my_stats().pages_held == 0
        with pytest.raises(errors.FailedPrecondition, match="closed"):
            r.map(0, MiB)


def test_region_larger_than_budget_reserves_but_cannot_fill(daemon):
    with daemon.client() as c, c.open_session("r") as s, s.region(1 << 34) as r:  # 16 GiB of address space
        r.map(0, 64 * MiB)
        with pytest.raises(errors.ResourceExhausted):
            r.map(0, 1 << 30)
        assert r.mapped_bytes == 64 * MiB  # the failed map left the mapped prefix alone


def _memfd_bytes_in(lo: int, hi: int) -> int:
    """Bytes of [lo, hi) this process maps from a memfd (/proc/self/maps)."""
    n = 0
    with open("/proc/self/maps") as f:
        for line in f:
            if "memfd:" not in line:
                continue
            a, b = (int(x, 16) for x in line.split()[0].split("-"))
            n += max(0, min(b, hi) - max(a, lo))
    return n


def test_release_pages_across_holes_unmaps_every_run(daemon, backend):
    """release_pages over slots with a hole between them (two runs of
    adjacent pages, unmapped a run at a time by the host mapper): every page
    it gives back is unmapped in this process, no other one is, and the
    daemon holds just the rest."""
    ps = 2 * MiB
    with daemon.client() as c, c.open_session("r") as s, s.region(10 * ps) as r:
        r.map(0, 10 * ps)
        for i in range(10):
            r.write(i * ps, bytes([i + 1]))
        host = backend == "host"  # CUDA pages are no memfds in this process (the test driver's views)
        assert not host or _memfd_bytes_in(r.base, r.base + 10 * ps) == 10 * ps
        r.unmap(5 * ps, 2 * ps)  # the hole: slots 5 and 6
        assert r.release_pages(5) == 5  # slots 9, 8, 7, then 4, 3
        assert r.mapped_ranges() == [(0, 3 * ps)]
        assert s.my_stats().pages_held == 3
        assert not host or _memfd_bytes_in(r.base, r.base + 10 * ps) == 3 * ps
        assert [r.read(i * ps, 1) for i in range(3)] == [b"\x01", b"\x02", b"\x03"]
        r.map(3 * ps, 7 * ps)  # the unmapped runs are reserved again and map back, zeroed
        assert r.read(4 * ps, 1) == b"\x00" and r.read(9 * ps, 1) == b"\x00"
        assert_books(s.stats())
