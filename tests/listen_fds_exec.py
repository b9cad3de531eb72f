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
    high = [fcntl.fcntl(int(fd), fcntl.F_DUPFD_CLOEXEC, 1000) for _, fd in pairs]  # out of the way of 3..
    for _, fd in pairs:
        os.close(int(fd))
    for i, h in enumerate(high):
        os.dup2(h, 3 + i, inheritable=True)
        os.close(h)
    os.environ["LISTEN_PID"] = str(os.getpid())
    os.environ["LISTEN_FDS"] = str(len(pairs))
    os.environ["LISTEN_FDNAMES"] = ":".join(name for name, _ in pairs)
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
