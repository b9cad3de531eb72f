"""The Python client's value types: what its public API returns.

Plain frozen dataclasses, no protobuf: the gRPC adapter (rpc.py) fills them
from the daemon's messages, the fd channel fills Allocation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass(frozen=True)
class Device:
    uuid: str
    name: str
    kind: str
    page_size: int
    granularity: int
    total_bytes: int
    budget_bytes: int


@dataclass(frozen=True)
class Info:
    """What the daemon says about itself (GetInfo)."""

    version: str
    api_version: int
    fd_socket: str
    fd_protocol_version: int
    backend: str
    devices: tuple[Device, ...]
    max_pages_per_request: int
    fd_channel_requests: bool
    fd_channel_requests_only: bool
    fd_channel_keep_handles: bool = False  # FREE's keep flag is honoured (docs/protocol.md, "Kept handles")
    fd_channel_standby: bool = False  # FREE's standby flag and USE are honoured (docs/protocol.md, "Standby pages")


class Allocation(NamedTuple):
    """The answer to an allocation; its page descriptors travel separately.
    (A NamedTuple: it is made on every Allocate, the hot path.)"""

    allocation_id: int
    device: str
    page_size: int
    page_ids: tuple[int, ...]
    held_bytes: int  # what the session holds on the device afterwards


@dataclass(frozen=True)
class PoolStats:
    budget_bytes: int
    pooled_bytes: int
    in_use_bytes: int
    free_bytes: int
    page_size: int
    pages_pooled: int
    pages_in_use: int
    pages_created_total: int
    pages_released_total: int
    unavailable_bytes: int = 0  # the configured limit the device does not have free (not in budget_bytes)
    zeroing_bytes: int = 0  # of pooled_bytes: given back, not zeroed yet (lent again once zeroed)
    pages_zeroing: int = 0
    standby_bytes: int = 0  # of in_use_bytes: kept mapped by sessions as standby


@dataclass(frozen=True)
class SessionStats:
    id: int
    name: str
    pid: int
    uid: int
    held_bytes: int
    pages_held: int
    guaranteed_bytes: int
    max_bytes: int
    priority: int
    last_active_unix: float
    reclaim_ignored: int
    allocations_total: int
    frees_total: int
    labels: dict
    opened_unix: float
    held_bytes_by_device: dict
    reclaim_pending_pages: int
    reclaim_requests: int
    standby_bytes: int = 0  # of held_bytes: kept mapped as standby (docs/protocol.md, "Standby pages")


@dataclass(frozen=True)
class Stats:
    total: PoolStats
    devices: dict[str, PoolStats]
    sessions: list[SessionStats]
    uptime_seconds: float
    sessions_open: int


@dataclass(frozen=True)
class Event:
    """A Watch event. kind: READY, RECLAIM, BUDGET_CHANGED, MEMORY_AVAILABLE, SHUTDOWN."""

    kind: str
    time_unix: float
    device: str = ""
    pages: int = 0
    deadline_unix: float = 0.0
    reason: str = ""
    data: dict = field(default_factory=dict)
    reclaim_id: int = 0  # RECLAIM: answer it with Session.answer_reclaim(event, given, kept, why)


@dataclass(frozen=True)
class ReclaimOutcome:
    """How one reclaim request of a RequestShrink stands (Session.shrink).
    state: OPEN (not settled yet), MET (the session holds no more than asked),
    ANSWERED (it said what it gave and keeps), EXPIRED (neither, by the
    deadline), ENDED (the session ended)."""

    reclaim_id: int
    device: str
    pages_requested: int
    state: str
    answered: bool
    bytes_given: int
    bytes_kept: int
    reason: str
    held_bytes: int  # the daemon's books: what the session holds on the device now


@dataclass(frozen=True)
class Shrink:
    """The answer to Session.shrink: pages asked for, and each request's outcome."""

    pages_requested: int
    reclaims: tuple[ReclaimOutcome, ...]


@dataclass(frozen=True)
class Opened:
    """A session the daemon opened (OpenSession) or resumed (ResumeSession)."""

    id: int
    token: bytes
    admin: bool
    pid: int = 0
    uid: int = 0
    gid: int = 0
    resume_token: bytes = b""
    pages_adopted: int = 0
    pages_forgotten: int = 0
