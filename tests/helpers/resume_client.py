"""A busy client for the daemon-restart tests: `resume_client.py SECONDS`.

Grows and trims a Region, stamping every page it maps with a pattern and
checking every mapped page on each round. While the daemon is down its
calls fail with UNAVAILABLE (counted) and it keeps checking the pages it
holds; when the daemon is back the session resumes by itself. Prints one
JSON line at the end.
"""

import json
import os
import random
import sys
import time

from kvcached_service import errors
from kvcached_service.client import Client

MiB = 1 << 20


def stamp(slot: int, gen: int) -> bytes:
    return f"{os.getpid()}:{slot}:{gen}".encode().ljust(32, b".")


def main() -> int:
    seconds = float(sys.argv[1])
    rng = random.Random(os.getpid())
    client = Client.from_env()
    s = client.open_session(f"busy-{os.getpid()}")
    r = s.region(48 * MiB)
    ps = r.page_size
    gens: dict[int, int] = {}
    rounds = unavailable = bad = 0
    print(json.dumps({"ready": True, "session": s.id}), flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        # every page we hold must still carry its stamp, daemon up or down
        for slot, gen in gens.items():
            if r.read(slot * ps, 32) != stamp(slot, gen):
                bad += 1
        try:
            target = rng.randint(1, r.n_slots)
            r.grow_to(target * ps)
            for slot in range(target):
                if slot not in gens:
                    gens[slot] = rounds
                    r.write(slot * ps, stamp(slot, rounds))
            keep = rng.randint(1, target)
            r.trim_to(keep * ps)
            for slot in [k for k in gens if k >= keep]:
                del gens[slot]
            rounds += 1
        except errors.Unavailable:
            unavailable += 1
            # pages unmapped locally before a failed Free are gone from the
            # region either way: forget their stamps
            for slot in [k for k in gens if not r.is_mapped(k * ps)]:
                del gens[slot]
            time.sleep(0.05)
    for slot, gen in gens.items():
        if r.read(slot * ps, 32) != stamp(slot, gen):
            bad += 1
    held = s.my_stats().pages_held
    out = {"rounds": rounds, "unavailable": unavailable, "bad": bad, "resumes": s.resumes,
           "held": held, "mapped": r.mapped_pages, "session": s.id}
    r.close()
    s.close()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
