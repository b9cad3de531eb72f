"""What the daemon tells systemd (host/sdnotify.py speaks the protocol):
READY=1 once it serves, a STATUS line of its books, the watchdog's pings."""

from __future__ import annotations

import logging

from ...config import format_size
from ..core.daemon import Daemon
from ..host.sdnotify import Notifier, watchdog_seconds

log = logging.getLogger("kvcached.sdnotify")


def status_line(daemon: Daemon) -> str:
    """'serving 3 sessions; 1.50 GiB in use, 256 MiB pooled, budget 20 GiB on 2 devices'"""
    pools = list(daemon.pools.values())
    books = [p.books() for p in pools]
    in_use = sum(b.in_use_bytes for b in books)
    pooled = sum(b.pooled_bytes for b in books)
    budget = sum(b.budget_bytes for b in books)
    n = len(daemon.sessions)
    where = f"{len(pools)} devices" if len(pools) != 1 else pools[0].uuid if pools else "no device"
    return (
        f"serving {n} session{'s' if n != 1 else ''}; {format_size(in_use)} in use, "
        f"{format_size(pooled)} pooled, budget {format_size(budget)} on {where}"
    )


def start_for(daemon: Daemon) -> Notifier:
    """ops/main.py's one call once the daemon serves: READY=1, STATUS, watchdog."""
    n = Notifier.from_env()
    if n.enabled:
        wd = watchdog_seconds()
        n.start(lambda: status_line(daemon), wd)
        log.info("sd_notify: READY sent to %s%s", n.address, f", watchdog every {wd / 2:g} s" if wd else "")
    return n
