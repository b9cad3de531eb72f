"""Python client of kvcached-serve: sessions, mapped pages and Regions."""

from ..errors import KVCachedError
from .client import Client, Device, Event, Page, PoolStats, Session, SessionStats, Stats, socket_from_env
from .region import Region

__all__ = [
    "Client",
    "Device",
    "Event",
    "KVCachedError",
    "Page",
    "PoolStats",
    "Region",
    "Session",
    "SessionStats",
    "Stats",
    "socket_from_env",
]
