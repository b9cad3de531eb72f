"""The budget and the counts of one device pool: what may be lent, and the
numbers every reader sees.

    pooled + in_use + free == budget        (in pages; times page_size bytes)

where
    pooled  = pages held by no session: ready, being zeroed, or being created
              for the warm pool
    in_use  = pages held by sessions (or being delivered) + pages being
              created for an Allocate
    free    = budget not backed by any page

`Counts` owns those numbers (only the pool's parts change them, on the event
loop thread, before any await, so every snapshot adds up); `Budget` is what
the device may lend now; `Books` is the frozen snapshot readers get;
`admit` is admission, policy only. The three limits, on every device:
- session maximum: the pages a session holds never exceed
  min(device budget, max_bytes) (max_bytes 0 = the device budget);
- device budget: a session never holds more than the device's budget;
- sum of guarantees: the guarantees of all open sessions fit in the budget
  of every device (a guarantee applies per device).
Plus the check that belongs with them: a guarantee above the maximum. (The
size of one request, 1..max_pages_per_request, is checked by the core
before the device is looked up.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .... import errors
from ....config import format_size


class PageIds:
    """The daemon's page-id counter, shared by its pools (a page id names a
    page across devices and restarts). Owned by the Daemon, not global."""

    def __init__(self, start: int = 1):
        self._next = start

    def next(self) -> int:
        n = self._next
        self._next += 1
        return n

    def take(self, n: int) -> range:
        """`n` ids at once (a batch of new pages)."""
        first = self._next
        self._next += n
        return range(first, first + n)

    def peek(self) -> int:
        """The id the next page will get (the journal records it)."""
        return self._next

    def continue_from(self, start: int) -> None:
        """After a restart: never reuse a page id the journal knows."""
        self._next = max(self._next, start)


@dataclass
class PoolCounters:
    created_total: int = 0
    released_total: int = 0
    allocations_total: int = 0
    allocation_failures_total: int = 0


@dataclass
class ZeroCounters:
    """What the background zeroer did (pool.zeroer), read by metrics."""

    batches_total: int = 0  # zero_pages calls on the zeroing worker
    pages_total: int = 0  # pages zeroed
    failures_total: int = 0  # pages released because zeroing failed
    waits_total: int = 0  # Allocates that waited for zeroing (no zeroed page was left)
    wait_seconds_total: float = 0.0


class Budget(NamedTuple):
    """A device's budget: what the daemon may lend on it now, in pages. What
    admission reads. The configured limit (memory_limit resolved for the
    device), capped by what the device really has: the pages the pool
    accounts for plus the device's free memory (DevicePool.set_supply). A
    new tuple replaces the old one when that changes."""

    device: str
    page_size: int
    pages: int

    @property
    def bytes(self) -> int:
        """The budget in bytes: the one place it is derived."""
        return self.pages * self.page_size


class Counts:
    """The pool's page counts (see the module docstring). Plain fields: the
    request path reads them on every Allocate."""

    __slots__ = ("pooled", "held", "creating", "budget_pages", "limit_pages", "standby")

    def __init__(self, limit_pages: int):
        self.pooled = 0  # held by no session: ready, being zeroed, being created for the warm pool
        self.held = 0  # held by sessions (orphans of a previous daemon included)
        self.creating = 0  # being created for an Allocate
        self.standby = 0  # of held: kept mapped by their sessions as standby (FREE with standby)
        self.limit_pages = limit_pages  # the configured limit
        self.budget_pages = limit_pages  # the limit capped by supply (set_supply)

    @property
    def in_use(self) -> int:
        return self.held + self.creating

    @property
    def free(self) -> int:
        return self.budget_pages - self.pooled - self.in_use


def _label(session) -> str:
    """A session for messages: a label as given, or a Session as `ID 'name'`
    (formatted only when a message is made: admit runs on every Allocate)."""
    return session if isinstance(session, str) else f"{session.id} '{session.name}'"


def admit(
    budgets: list[Budget],
    *,
    session,
    guaranteed_bytes: int,
    max_bytes: int,
    others_guaranteed: int | None = None,
    device: str | None = None,
    held_pages: int = 0,
    more_pages: int = 0,
) -> None:
    """Raise the client's error if `session` (a label for messages, or the Session) may not
    have these limits, or may not hold `held_pages + more_pages` pages on
    `device`. `others_guaranteed`: the guarantees of every other open
    session, given when the limits are set or changed (OpenSession,
    SetSessionLimits), None on an Allocate (the sum was admitted then)."""
    if max_bytes and guaranteed_bytes > max_bytes:
        raise errors.InvalidArgument(f"guaranteed_bytes {guaranteed_bytes} exceeds max_bytes {max_bytes}")
    if guaranteed_bytes and others_guaranteed is not None:
        total = others_guaranteed + guaranteed_bytes
        for b in budgets:
            if total > b.bytes:
                raise errors.ResourceExhausted(
                    f"guarantees would total {format_size(total)}, more than device {b.device}'s budget {format_size(b.bytes)}"
                )
    if device is None:
        return
    (b,) = [x for x in budgets if x.device == device]
    cap = b.pages if not max_bytes else min(b.pages, max_bytes // b.page_size)
    if held_pages + more_pages > cap:
        raise errors.ResourceExhausted(
            f"session {_label(session)} holds {held_pages} pages on {b.device}; {more_pages} more would exceed its maximum of {cap} pages"
            + (f" (max_bytes {format_size(max_bytes)})" if max_bytes else " (the device budget)")
        )


@dataclass(frozen=True)
class Books:
    """One device's books at one instant, in pages: the read model every
    reader uses (GetStats, metrics, sd_notify, kvcachedctl through GetStats,
    tests). Only DevicePool writes the numbers it is made from.

        pooled + in_use + free == budget
    """

    budget: Budget
    pooled: int
    in_use: int
    free: int
    created_total: int
    released_total: int
    allocations_total: int
    allocation_failures_total: int
    unavailable: int = 0  # pages of the configured limit the device does not have (not in budget)
    zeroing: int = 0  # of `pooled`: freed pages waiting for (or in) background zeroing
    # the background zeroer's counters (ZeroCounters), as of this snapshot
    zeroed_total: int = 0
    zero_batches_total: int = 0
    zero_failures_total: int = 0
    zero_waits_total: int = 0
    zero_wait_seconds_total: float = 0.0
    # kept handles (pool/keepers.py): of `pooled`, pages a client keeps a handle of
    kept: int = 0
    drops_total: int = 0  # pages DROP asked keepers for
    drop_silent_total: int = 0  # keepers that lost their session for not answering
    standby: int = 0  # of `in_use`: pages sessions keep mapped as standby

    @property
    def device(self) -> str:
        return self.budget.device

    @property
    def page_size(self) -> int:
        return self.budget.page_size

    @property
    def budget_pages(self) -> int:
        return self.budget.pages

    @property
    def budget_bytes(self) -> int:
        return self.budget.bytes

    @property
    def pooled_bytes(self) -> int:
        return self.pooled * self.page_size

    @property
    def in_use_bytes(self) -> int:
        return self.in_use * self.page_size

    @property
    def free_bytes(self) -> int:
        return self.free * self.page_size

    @property
    def unavailable_bytes(self) -> int:
        return self.unavailable * self.page_size

    def check(self) -> None:
        """Assert the books add up (GetStats calls it on every snapshot)."""
        assert self.pooled + self.in_use + self.free == self.budget_pages, self
        assert self.free >= 0, f"budget overdrawn by {-self.free} pages"
        assert 0 <= self.standby <= self.in_use, self
        assert 0 <= self.zeroing <= self.pooled, self


class Shortage(errors.ResourceExhausted):
    """Not enough budget; carries the numbers for the message and for reclaim."""

    def __init__(self, message: str, missing: int):
        super().__init__(message)
        self.missing = missing
