"""What the core shares with recovery, and what it asks of it.

- `Ledger`: the core's books that a restart must carry (through the
  journal, recovery/): the sessions, the pools, the ids given so far, the
  tombstones of ended sessions, the event counters. The core owns them;
  recovery gets the Ledger, not the core.
- `RecoveryPort`: the calls the core makes when its books change (record,
  lent, returned, ended), its housekeeping and ResumeSession.
  recovery/resume.py's Recovery is the one with a journal; the core starts
  with `NoRecovery` (no --state-dir), and ops/main.py attaches a Recovery.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ... import errors
from .pool import PageIds
from .sessions import Tombstones

if TYPE_CHECKING:
    from .pool import DevicePool, Page
    from .sessions import Session


@dataclass
class Ledger:
    sessions: dict[int, "Session"] = field(default_factory=dict)
    pools: dict[str, "DevicePool"] = field(default_factory=dict)
    tombstones: Tombstones = field(default_factory=Tombstones)
    page_ids: PageIds = field(default_factory=PageIds)
    next_session_id: int = 1
    counters: dict[str, int] = field(default_factory=dict)

    def count(self, counter: str) -> None:
        self.counters[counter] = self.counters.get(counter, 0) + 1


class RecoveryPort(Protocol):
    # whether changes are journaled (a state dir): sessions get resume tokens,
    # loans are journaled (an attribute: the core reads it on every loan)
    journaling: bool
    # why the journal was found damaged at the start, or cannot be written now (metrics)
    journal_damage: dict | None
    journal_stale: str | None

    def record(self, rec: dict) -> None: ...

    def lent(self, s: "Session", pool: "DevicePool", pages: list["Page"], fds: list[int]) -> None: ...

    def returned(self, s: "Session", pages: list["Page"]) -> None: ...

    def ended(self, s: "Session") -> None: ...

    def may_adopt(self, session_id: int, uid: int, page_id: int) -> bool: ...

    async def resume(self, caller_uid: int | None, secret: bytes, sid: int, token: bytes,
                     page_ids: list[int]) -> tuple["Session", int, int]: ...

    def expire(self, now: float) -> None: ...

    def rewrite_stale_journal(self, now: float) -> None: ...

    async def restore_store(self, now: float) -> None: ...

    def close(self, keep: bool = False) -> None:
        """The daemon stops: keep the journal and the page store for the next
        start (keep), or remove them (every session ended)."""


class NoRecovery:
    """Without --state-dir: nothing is journaled, nothing can be resumed."""

    journaling = False
    journal = None
    journal_damage = None
    journal_stale = None

    def record(self, rec: dict) -> None:
        pass

    def lent(self, s, pool, pages, fds) -> None:
        pass

    def returned(self, s, pages) -> None:
        pass

    def ended(self, s) -> None:
        pass

    def may_adopt(self, session_id: int, uid: int, page_id: int) -> bool:
        return False

    async def resume(self, caller_uid, secret, sid, token, page_ids):
        raise errors.FailedPrecondition("this daemon keeps no journal (--state-dir), so sessions cannot be resumed; open a new one")

    def expire(self, now: float) -> None:
        pass

    def rewrite_stale_journal(self, now: float) -> None:
        pass

    async def restore_store(self, now: float) -> None:
        pass

    def close(self, keep: bool = False) -> None:
        pass
