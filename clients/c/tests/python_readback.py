"""Half of the C -> Python read-back test (test_integration.cc, PythonReadsCWrites).

Allocates one page with the Python client, maps it, and frees it while
keeping the mapping (the protocol allows this; the page stays physically
alive and the daemon may hand it to another session of the same uid, never
to another uid), and waits until the daemon has zeroed it (a Free is
answered first). The C test then allocates one page (the daemon hands out a
same-uid pooled page first, LIFO), writes a pattern through its C mapping,
and tells us; we read the bytes through our own mapping and print them.
"""

import sys
import time

from kvcached_service.client import Client

sock = sys.argv[1]
with Client.connect(sock) as client:
    session = client.open_session("python-readback")
    resp, fds = session.allocate_fds(1)
    mapper = session.mapper(resp.device)
    base = mapper.reserve(resp.page_size)
    token = mapper.map(base, fds[0], resp.page_size)
    session.free_ids(resp.page_ids)
    # the Free is answered before the daemon zeroes the page (in the
    # background); once zeroed it is the most recent page pooled for this uid
    deadline = time.monotonic() + 30
    while session.stats().total.pages_zeroing and time.monotonic() < deadline:
        time.sleep(0.01)
    print("READY", resp.page_ids[0], flush=True)
    sys.stdin.readline()  # the C side has written
    head = mapper.read(base, 64)
    tail = mapper.read(base + resp.page_size - 64, 64)
    print("DATA", head.hex(), tail.hex(), flush=True)
    mapper.unmap(base, resp.page_size, token)
    mapper.release(base, resp.page_size)
    session.close()
