"""Region: the elastic KV primitive.

Reserve address space for the largest size once; back any page-aligned range
of it with daemon pages on demand, and give pages back when a range is no
longer needed. Growing a prefix is the common case, but llama.cpp keeps all
layers' K and V tensors in one buffer and each needs its own prefix
[0, n_kv) mapped, so a Region maps and unmaps arbitrary page-aligned ranges,
and `map_ranges` backs several ranges with one Allocate.

Standby (docs/protocol.md, "Standby pages"): `unmap(..., standby=True)`
keeps the range's pages mapped and the session's, but not in use; mapping
the range again takes them back with no Allocate and no driver call (a USE
record, not waited for). A reclaim (`release_pages`) gives standby pages
first. From the caller's view a standby range is unmapped.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Iterable

from .. import errors, fdchannel

if TYPE_CHECKING:
    from .client import Device, Session


def _runs(slots: list[int]) -> list[tuple[int, int]]:
    """The runs of adjacent slots in a sorted list, as (start, end) index
    pairs into it: [3, 4, 7] -> [(0, 2), (2, 3)]."""
    runs, start = [], 0
    for k in range(1, len(slots) + 1):
        if k == len(slots) or slots[k] != slots[k - 1] + 1:
            runs.append((start, k))
            start = k
    return runs


class Region:
    def __init__(self, session: "Session", device: "Device", size: int):
        if size <= 0:
            raise errors.InvalidArgument(f"region size must be positive, got {size}")
        self.session = session
        self.device = device
        self.page_size = device.page_size
        self.n_slots = -(-size // self.page_size)
        self.size = self.n_slots * self.page_size
        self.requested = size  # a range ending here ends at self.size (the last page's padding is the region's)
        self._mapper = session.mapper(device.uuid)
        self.base = self._mapper.reserve(self.size)
        self._slots: list[tuple[int, object] | None] = [None] * self.n_slots  # (page id, map token)
        self._lock = threading.Lock()
        self._pending: set[int] = set()  # slots whose pages are being allocated
        self._standby: set[int] = set()  # slots whose pages are mapped but kept as standby (not in use)
        self._closed = False

    # ---- ranges ---------------------------------------------------------
    def _slot_range(self, offset: int, length: int) -> range:
        ps = self.page_size
        if offset < 0 or length < 0:
            raise errors.InvalidArgument(f"negative offset or length: [{offset}, +{length})")
        if offset % ps:
            raise errors.InvalidArgument(f"offset {offset} is not a multiple of the page size {ps}")
        end = offset + length
        if end > self.size:
            raise errors.InvalidArgument(f"range [{offset}, {end}) is outside the region of {self.size} bytes")
        return range(offset // ps, -(-end // ps))

    def map(self, offset: int, length: int, *, wait: bool = False, wait_timeout_ms: int = 0) -> int:
        """Back [offset, offset+length) (rounded up to whole pages) with pages.
        Returns the number of pages newly mapped."""
        return self.map_ranges([(offset, length)], wait=wait, wait_timeout_ms=wait_timeout_ms)

    def map_ranges(self, ranges: Iterable[tuple[int, int]], *, wait: bool = False, wait_timeout_ms: int = 0) -> int:
        """Back several ranges with one Allocate for all their missing pages.
        With wait, the daemon may ask other sessions for pages first. The
        region's lock is not held while the daemon works, so a reclaim
        callback of this session can trim other ranges meanwhile."""
        with self._lock:
            self._check_open()
            want: list[int] = []
            seen: set[int] = set()  # not `i not in want`: that made a big grow quadratic (1,843 pages: ~1.7M compares)
            slots, pending, standby = self._slots, self._pending, self._standby
            back: list[int] = []  # page ids of standby slots taken back into use
            for off, length in ranges:
                for i in self._slot_range(off, length):
                    if standby and i in standby:
                        standby.discard(i)
                        back.append(slots[i][0])  # type: ignore[index]
                    elif slots[i] is None and i not in pending and i not in seen:
                        seen.add(i)
                        want.append(i)
            if back:
                self.session.use_ids(back)
            if not want:
                return len(back)
            self._pending.update(want)
        try:
            resp, fds = self.session.allocate_fds(len(want), self.device.uuid, wait, wait_timeout_ms)
        except BaseException:
            with self._lock:
                self._pending.difference_update(want)
            raise
        with self._lock:
            self._pending.difference_update(want)
            # by slot, each run of adjacent slots mapped with one call (on CUDA: one cuMemSetAccess per run)
            items = sorted(zip(want, resp.page_ids, range(len(want))))  # (slot, page id, index in fds)
            done: list[int] = []  # slots mapped
            try:
                self._check_open()
                for a, b in _runs([slot for slot, _, _ in items]):
                    run = items[a:b]
                    run_fds = [fds[i] for _, _, i in run]
                    for _, _, i in run:
                        fds[i] = -1  # map_run closes them, whatever happens
                    tokens = self._mapper.map_run(self.base + run[0][0] * self.page_size, run_fds, self.page_size,
                                                  [pid for _, pid, _ in run])
                    for (slot, pid, _), token in zip(run, tokens):
                        self._slots[slot] = (pid, token)
                        done.append(slot)
            except BaseException:
                fdchannel.close_fds(fd for fd in fds if fd >= 0)
                for slot in done:
                    self._unmap_slot(slot)
                try:
                    self.session.free_ids(resp.page_ids)
                except errors.KVCachedError:
                    pass
                raise
            return len(want) + len(back)

    def unmap(self, offset: int, length: int, *, standby: bool = False) -> int:
        """Unmap the pages of [offset, offset+length) and give them back with
        one Free. The range stays reserved. A range that runs to the region's
        end (the size it was created with, or the page-rounded size) releases
        its last page too. Returns pages given back. standby: keep them
        mapped as standby instead (still the session's; mapping the range
        again takes them back at no cost; a reclaim gives them first) on a
        daemon that offers it (else they are given back)."""
        with self._lock:
            self._check_open()
            if length % self.page_size and offset + length not in (self.size, self.requested):
                raise errors.InvalidArgument(f"length {length} is not a multiple of the page size {self.page_size}")
            slots = list(self._slot_range(offset, length))
            if standby and self.session.client.info.fd_channel_standby:
                return self._to_standby(slots)
            return self._unmap_slots(slots)

    def _to_standby(self, slots: list[int]) -> int:
        picked = [i for i in dict.fromkeys(slots) if self._slots[i] is not None and i not in self._standby]
        if picked:
            self.session.standby_ids([self._slots[i][0] for i in picked])  # type: ignore[index]
            self._standby.update(picked)
        return len(picked)

    def _unmap_slots(self, slots: list[int]) -> int:
        self._standby.difference_update(slots)
        order = [i for i in dict.fromkeys(slots) if self._slots[i] is not None]
        live = sorted(order)
        freed: dict[int, int] = {}  # slot -> page id, unmapped
        failed: BaseException | None = None
        for a, b in _runs(live) if self._mapper.unmaps_runs else ((k, k + 1) for k in range(len(live))):
            first, n = live[a], b - a
            if n > 1:  # a run of adjacent slots: one unmap (on CUDA one cuMemUnmap over the run's mappings)
                try:
                    self._mapper.unmap(self.base + first * self.page_size, n * self.page_size, None)
                except Exception:  # noqa: BLE001 - page by page below says which pages are still mapped
                    pass
                else:
                    freed.update((i, self._slots[i][0]) for i in range(first, first + n))  # type: ignore[index]
                    self._slots[first:first + n] = [None] * n
                    continue
            for i in range(first, first + n):
                pid = self._slots[i][0]  # type: ignore[index]
                try:
                    self._unmap_slot(i)
                except Exception as exc:  # still mapped: kept, and not freed
                    failed = failed or exc
                else:
                    freed[i] = pid
        ids = [freed[i] for i in order if i in freed]  # one Free, in the caller's order (release_pages: standby first)
        if ids:
            self.session.free_ids(ids)
        if failed is not None:
            raise failed
        return len(ids)

    def _unmap_slot(self, i: int) -> None:
        entry = self._slots[i]
        if entry is not None:
            self._mapper.unmap(self.base + i * self.page_size, self.page_size, entry[1])
            self._slots[i] = None

    def grow_to(self, nbytes: int, *, wait: bool = False, wait_timeout_ms: int = 0) -> int:
        """Make sure the prefix [0, nbytes) is mapped."""
        return self.map(0, nbytes, wait=wait, wait_timeout_ms=wait_timeout_ms)

    def trim_to(self, nbytes: int, *, standby: bool = False) -> int:
        """Give back every page past the first `nbytes` (rounded up to pages);
        standby: keep them mapped as standby instead (see unmap)."""
        keep = -(-nbytes // self.page_size) * self.page_size
        if keep >= self.size:
            return 0
        return self.unmap(keep, self.size - keep, standby=standby)

    def release_pages(self, pages: int, keep_bytes: int = 0) -> int:
        """Answer a reclaim request: give back up to `pages` pages, standby
        ones first, then from the end of the mapped area, never below the
        first `keep_bytes`. Returns pages given back."""
        with self._lock:
            floor = -(-keep_bytes // self.page_size)
            slots = sorted(self._standby, reverse=True)[:pages]
            if len(slots) < pages:
                used = [i for i in range(self.n_slots - 1, floor - 1, -1) if self._slots[i] is not None and i not in self._standby]
                slots += used[: pages - len(slots)]
            return self._unmap_slots(slots)

    # ---- inspection -----------------------------------------------------
    def _live(self, i: int) -> bool:
        """Slot i is mapped and in use (not standby)."""
        return self._slots[i] is not None and i not in self._standby

    @property
    def mapped_pages(self) -> int:
        return sum(1 for s in self._slots if s is not None) - len(self._standby)

    @property
    def standby_pages(self) -> int:
        """Pages kept mapped as standby (not in use)."""
        return len(self._standby)

    @property
    def mapped_bytes(self) -> int:
        return self.mapped_pages * self.page_size

    def is_mapped(self, offset: int) -> bool:
        return self._live(offset // self.page_size)

    def mapped_ranges(self) -> list[tuple[int, int]]:
        """[(offset, length)] of the mapped runs, in order."""
        out: list[tuple[int, int]] = []
        for i, s in enumerate(self._slots):
            if s is None or i in self._standby:
                continue
            off = i * self.page_size
            if out and out[-1][0] + out[-1][1] == off:
                out[-1] = (out[-1][0], out[-1][1] + self.page_size)
            else:
                out.append((off, self.page_size))
        return out

    def page_ids(self) -> list[int]:
        """Ids of the pages mapped and in use."""
        return [s[0] for i, s in enumerate(self._slots) if s is not None and i not in self._standby]

    # ---- data (tests, demos; engines use the address directly) ----------
    def _check_mapped(self, offset: int, size: int) -> None:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise errors.InvalidArgument(f"range [{offset}, {offset + size}) is outside the region")
        for i in range(offset // self.page_size, -(-(offset + size) // self.page_size)):
            if not self._live(i):
                raise errors.FailedPrecondition(f"byte {max(offset, i * self.page_size)} of the region is not mapped")

    def write(self, offset: int, data: bytes) -> None:
        self._check_mapped(offset, len(data))
        self._mapper.write(self.base + offset, data)

    def read(self, offset: int, size: int) -> bytes:
        self._check_mapped(offset, size)
        return self._mapper.read(self.base + offset, size)

    def clear(self) -> None:
        """Zero every mapped page (and only those: unmapped ranges stay unbacked)."""
        zero = bytes(self.page_size)
        for i, s in enumerate(self._slots):
            if s is not None and i not in self._standby:
                self._mapper.write(self.base + i * self.page_size, zero)

    # ---- life cycle -----------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise errors.FailedPrecondition("region is closed")

    def close(self) -> None:
        """Unmap and give back every page, then release the reservation."""
        with self._lock:
            if self._closed:
                return
            try:
                self._unmap_slots(list(range(self.n_slots)))
            except errors.KVCachedError:
                pass  # the session may be gone; the pages are unmapped either way
            self._closed = True
            self._mapper.release(self.base, self.size)

    def __enter__(self) -> "Region":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
