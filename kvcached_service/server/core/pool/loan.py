"""A loan: pages lent to a session and the descriptors that deliver them.

The descriptors are the pages' own kept ones (a host memfd; a CUDA page's
export, made once when the page was created and kept for its life), sent
as they are (SCM_RIGHTS gives the receiver its own copy), and, for pages
that keep none (over the daemon's fd cap), exports made for this delivery:
those the loan owns, and closes once it was delivered or given up
(`close`). Nothing else a loan holds needs closing.
"""

from __future__ import annotations

from typing import NamedTuple

from ....fdchannel import close_fds
from .pages import Page


class Loan(NamedTuple):
    """Pages lent to a session (DevicePool.lend): HELD by it in the pool's
    books, `fds[i]` the descriptor of `pages[i]`; `owned` the ones made for
    this delivery (a subset of fds), the loan's to close."""

    pages: list[Page]
    fds: list[int]
    owned: tuple[int, ...] = ()

    def close(self) -> None:
        """The delivery is over (sent, or given up): close what the loan owns.
        Idempotent only in the sense that the caller calls it once."""
        if self.owned:
            close_fds(list(self.owned))
