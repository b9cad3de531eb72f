"""Admission: may a session hold this much? One function, `admit`.

Policy only: it reads the devices' budgets and the sessions' limits and raises the
error a client sees; it changes nothing. Whether pages can be had *now*
(pooled, free budget, another uid's pooled pages to release) is the pool's
supply question (DevicePool.acquire, which raises Shortage); whether other
sessions should be asked to give pages back is elastic.py's.

The three limits, on every device:
- session maximum: the pages a session holds never exceed
  min(device budget, max_bytes) (max_bytes 0 = the device budget);
- device budget: a session never holds more than the device's budget;
- sum of guarantees: the guarantees of all open sessions fit in the budget
  of every device (a guarantee applies per device).
Plus the check that belongs with them: a guarantee above the maximum. (The
size of one request, 1..max_pages_per_request, is checked by Daemon.allocate
before the device is looked up.)
"""

from __future__ import annotations

from ..config import format_size
from .. import errors
from .pool import Budget


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
