"""Is a session's client process still alive: the daemon's one reader of
/proc for other processes.

A session records its client's pid (SO_PEERCRED, as the kernel named the
peer of its fd channel) and that process's start time (field 22 of
/proc/PID/stat, clock ticks since boot). A pid alone names a process only
until it is reused; a pid with its start time names one process for the
life of the boot. Both mean something only in the pid namespace and the
boot they were read in, so the journal also records `scope()`: a restarted
daemon in another pid namespace (a new container) or after a reboot cannot
tell, and says so (`gone` answers None).
"""

from __future__ import annotations

import os


def start_time(pid: int) -> int | None:
    """The start time of process `pid` (clock ticks since boot), or None
    when there is no such process here (or it cannot be read)."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(4096)
    except OSError:
        return None
    # pid (comm) state ppid ...: comm may hold spaces and parentheses, so
    # the fields are counted from the last ')'
    tail = stat[stat.rfind(b")") + 2:].split()
    try:
        return int(tail[19])  # field 22 of the whole line
    except (IndexError, ValueError):
        return None


def scope() -> str:
    """Where pids and start times mean what they say: this pid namespace in
    this boot ("" when either cannot be read)."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        return ""
    return f"{ns} boot {boot}"


def gone(pid: int, started: int, recorded_in: str) -> bool | None:
    """Whether the process recorded as (`pid`, `started`) in scope
    `recorded_in` has exited: True or False where this daemon can tell,
    None where it cannot (no pid recorded, or another pid namespace or
    boot)."""
    here = scope()
    if pid <= 0 or started <= 0 or not recorded_in or recorded_in != here:
        return None
    return start_time(pid) != started
