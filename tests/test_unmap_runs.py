"""Unmapping a run of adjacent pages is one call (issue 42 item 3).

The Python client's CUDA mapper unmaps each run of adjacent pages of a
region with one cuMemUnmap over the run's mappings (the driver unmaps a
range made of whole mappings, as it sets access over one), instead of one
call per page. Counted here by wrapping the driver the mapper loads; a run
the driver refuses is unmapped page by page, and a page that cannot be
unmapped stays mapped and is not freed.
"""

from __future__ import annotations

import pytest

from kvtest import assert_books
from kvcached_service.cuda import driver as cu

MiB = 1 << 20
PAGE = 2 * MiB


class _Counting:
    """The loaded driver, with cuMemUnmap counted (and failed on demand)."""

    def __init__(self, load):
        self._load = load
        self._real: cu.Driver | None = None
        self.unmaps: list[int] = []  # sizes, in calls order
        self.fail_when = lambda ptr, size: False

    def cuMemUnmap(self, ptr, size):  # noqa: N802 - the driver's name
        self.unmaps.append(int(size))
        if self.fail_when(int(ptr), int(size)):
            raise cu.make_error("cuMemUnmap", 1, "CUDA_ERROR_INVALID_VALUE")
        return self._drv.cuMemUnmap(ptr, size)

    @property
    def _drv(self) -> cu.Driver:
        if self._real is None:  # loaded when the first mapper is made (the daemon fixture sets the library)
            self._real = self._load()
        return self._real

    def __getattr__(self, name):
        return getattr(self._drv, name)


@pytest.fixture
def counting(monkeypatch):
    wrapped = _Counting(cu.load)
    monkeypatch.setattr(cu, "load", lambda path=None: wrapped)
    return wrapped


def _held(s) -> int:
    return s.my_stats().held_bytes


@pytest.mark.cuda
def test_a_run_of_adjacent_pages_is_unmapped_with_one_call(daemon_factory, counting):
    d = daemon_factory("cuda", memory_limit="64MiB", page_size="2MiB")
    with d.client() as c, c.open_session("runs") as s:
        r = s.region(16 * PAGE)
        r.map(0, 8 * PAGE)
        counting.unmaps.clear()
        assert r.unmap(0, 8 * PAGE) == 8
        assert counting.unmaps == [8 * PAGE]  # one call over the 8 mappings
        assert _held(s) == 0  # and all 8 freed
        # two runs (slots 0-2 and 5-6): two calls
        r.map(0, 3 * PAGE)
        r.map(5 * PAGE, 2 * PAGE)
        counting.unmaps.clear()
        assert r.unmap(0, 16 * PAGE) == 5
        assert sorted(counting.unmaps) == [2 * PAGE, 3 * PAGE]
        # a trim gives back the tail as one run; the rest stays mapped and readable
        r.map(0, 6 * PAGE)
        r.write(0, b"kept")
        counting.unmaps.clear()
        assert r.trim_to(2 * PAGE) == 4
        assert counting.unmaps == [4 * PAGE]
        assert r.mapped_bytes == 2 * PAGE and r.read(0, 4) == b"kept"
        r.close()
        assert_books(c.stats())


@pytest.mark.cuda
def test_a_run_the_driver_refuses_is_unmapped_page_by_page(daemon_factory, counting):
    d = daemon_factory("cuda", memory_limit="64MiB", page_size="2MiB")
    with d.client() as c, c.open_session("refused") as s:
        r = s.region(8 * PAGE)
        r.map(0, 4 * PAGE)
        counting.fail_when = lambda ptr, size: size > PAGE  # runs refused, single pages unmapped
        counting.unmaps.clear()
        assert r.unmap(0, 4 * PAGE) == 4
        assert counting.unmaps == [4 * PAGE, PAGE, PAGE, PAGE, PAGE]
        assert r.mapped_bytes == 0 and _held(s) == 0
        r.close()
        assert_books(c.stats())


@pytest.mark.cuda
def test_a_page_that_cannot_be_unmapped_stays_mapped_and_is_not_freed(daemon_factory, counting):
    d = daemon_factory("cuda", memory_limit="64MiB", page_size="2MiB")
    with d.client() as c, c.open_session("stuck") as s:
        r = s.region(8 * PAGE)
        r.map(0, 3 * PAGE)
        r.write(PAGE, b"still here")
        stuck = r.base + PAGE
        counting.fail_when = lambda ptr, size: size > PAGE or ptr == stuck
        with pytest.raises(cu.CudaDriverError):
            r.unmap(0, 3 * PAGE)
        counting.fail_when = lambda ptr, size: False
        assert r.mapped_bytes == PAGE  # the middle page: still mapped, still the session's
        assert _held(s) == PAGE
        assert r.read(PAGE, 10) == b"still here"
        assert r.unmap(0, 3 * PAGE) == 1
        assert _held(s) == 0
        r.close()
        assert_books(c.stats())
