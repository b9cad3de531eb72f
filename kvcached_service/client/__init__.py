"""Python client of kvcached-serve: sessions, mapped pages and Regions."""

from ..errors import KVCachedError
from .client import Client, Page, Session, socket_from_env
from .region import Region
from .types import Allocation, Device, Event, Info, PoolStats, ReclaimOutcome, SessionStats, Shrink, Stats

__all__ = [
    "Allocation",
    "Client",
    "Device",
    "Event",
    "Info",
    "KVCachedError",
    "Page",
    "PoolStats",
    "ReclaimOutcome",
    "Region",
    "Session",
    "SessionStats",
    "Shrink",
    "Stats",
    "socket_from_env",
]
