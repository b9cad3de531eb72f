#!/usr/bin/env python3
"""Demo: a page allocated by one process, written, and read by a second.

    python examples/share_page.py            # needs a running kvcached-serve

The first process opens a session, allocates one page (it arrives as a file
descriptor over the daemon's fd channel), maps it and writes into it. It then
starts a second process and hands it the same page's fd; the second process
maps it and reads the bytes back: one physical page, two address spaces, no
copy. On a GPU the fd is a CUDA shareable handle and both processes map it
with cuMemMap instead of mmap.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys


def reader(fd: int, size: int) -> None:
    with mmap.mmap(fd, size) as m:
        end = m.find(b"\0")
        print(f"[reader pid {os.getpid()}] read from the shared page: {m[:end].decode()!r}")


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--read":
        reader(int(sys.argv[2]), int(sys.argv[3]))
        return 0

    from kvcached_service.client import Client

    socket = os.environ.get("KVCACHED_SOCKET", "/tmp/kvcached.sock")
    with Client.connect(socket) as client, client.open_session("demo") as session:
        resp, fds = session.allocate_fds(1)
        page_id, fd, size = resp.page_ids[0], fds[0], resp.page_size
        with mmap.mmap(fd, size) as m:
            text = f"hello from pid {os.getpid()}, page {page_id}".encode()
            m[: len(text)] = text
        print(f"[writer pid {os.getpid()}] allocated page {page_id} ({size} bytes) on {resp.device}, wrote {text.decode()!r}")
        subprocess.run([sys.executable, __file__, "--read", str(fd), str(size)], pass_fds=[fd], check=True)
        os.close(fd)
        session.free_ids([page_id])
        st = client.stats().total
        print(f"[writer] freed it; daemon books: pooled {st.pooled_bytes} + in use {st.in_use_bytes} + free {st.free_bytes} = budget {st.budget_bytes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
