"""Play systemd's part of handing a service its stored fds (sd_listen_fds(3)):

    python tests/listen_fds_exec.py NAME=FD [NAME=FD ...] -- CMD [ARGS ...]

dups each FD (inherited from the caller) to 3, 4, ... in the order given,
sets LISTEN_PID (this process's pid, which exec keeps), LISTEN_FDS and
LISTEN_FDNAMES, closes the originals and execs CMD."""

from __future__ import annotations

import fcntl
import os
import sys


def main(argv: list[str]) -> None:
    sep = argv.index("--")
    pairs = [a.split("=", 1) for a in argv[:sep]]
    cmd = argv[sep + 1:]
    # Move source i to 3 + i in place, one fd at a time (thousands of fds
    # near RLIMIT_NOFILE leave no room for a second copy of them all): a
    # source sitting on a target slot is first moved to the lowest free
    # number above it.
    loc = [int(fd) for _, fd in pairs]  # where source i is now
    at = {fd: i for i, fd in enumerate(loc)}  # which source sits on a number
    for i in range(len(loc)):
        t = 3 + i
        if loc[i] == t:  # there already (maybe moved there, close-on-exec)
            os.set_inheritable(t, True)
            continue
        j = at.pop(t, None)
        if j is not None:  # another source on this slot: out of the way
            loc[j] = fcntl.fcntl(t, fcntl.F_DUPFD_CLOEXEC, t + 1)
            at[loc[j]] = j
            os.close(t)
        os.dup2(loc[i], t, inheritable=True)
        os.close(loc[i])
        del at[loc[i]]
        loc[i] = t
        at[t] = i
    os.environ["LISTEN_PID"] = str(os.getpid())
    os.environ["LISTEN_FDS"] = str(len(pairs))
    os.environ["LISTEN_FDNAMES"] = ":".join(name for name, _ in pairs)
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
