"""How long a restarted daemon takes to give a client back N pages from its
page store (issue 25): systemd's fd store beside the keeper process, in one
run, on the CUDA test driver (its default identity, chardev: every export
one device node's inode, so only a store can resume pages) or the host
backend:

    python -m bench.resume [--backend cuda|host] [--pages 1000,10000]

For each N and store: a daemon with --state-dir lends N pages of 64 KiB to
one session (a raw client that keeps no fds, so nothing is re-sent: every
page must come from the store); the daemon is SIGKILLed; a new one starts
on the same state dir and store. Reported: start (process start to health
SERVING: the journal read, the store's fds taken; both restarts exec
through tests/listen_fds_exec.py, systemd's hand-over of its fds; "own" is
the daemon's part, from its first log line to serving), resume (the client's
ResumeSession naming its N page ids, adopted from the store's fds) and
their sum, with the ratio systemd / keeper. systemd's side is played by
tests/systemdtest.py (no systemd here); the keeper is the real one.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from .common import PY, ROOT, TESTDRIVER

PAGE = 64 << 10
STORES = ("systemd", "keeper")


def _fake_systemd():
    sys.path.insert(0, str(ROOT / "tests"))
    from systemdtest import FakeSystemd

    return FakeSystemd


def _env(backend: str, work: pathlib.Path, pages: int) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    if backend == "cuda":
        (work / "gpu").mkdir(exist_ok=True)
        env.update(KVCACHED_LIBCUDA=str(TESTDRIVER), KVCACHED_TESTDRV_STATE=str(work / "gpu"),
                   KVCACHED_TESTDRV_GRANULARITY=str(PAGE), KVCACHED_TESTDRV_MEMORY=str(pages * PAGE + (256 << 20)))
        os.environ.update({k: env[k] for k in ("KVCACHED_LIBCUDA", "KVCACHED_TESTDRV_STATE",
                                               "KVCACHED_TESTDRV_GRANULARITY", "KVCACHED_TESTDRV_MEMORY")})
    return env


def _start(backend: str, work: pathlib.Path, store: str, pages: int, env: dict, sock: str, extra: dict | None = None):
    from kvcached_service.client.health import wait_serving

    args = ["--socket", sock, "--backend", backend, "--state-dir", str(work / "state"), "--page-store", store,
            "--page-size", str(PAGE), "--memory-limit", str(pages * PAGE + (8 << 20)), "--max-pages-per-request",
            str(pages), "--resume-grace", "120", "--log-level", "INFO"]
    extra = extra or {}
    log = open(work / f"daemon-{store}-{time.monotonic_ns()}.log", "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(extra.get("wrap", []) + [PY, "-m", "kvcached_service.server", *args], env=env, stdout=log,
                            stderr=subprocess.STDOUT, pass_fds=extra.get("pass_fds", ()), cwd=ROOT)
    if not wait_serving(sock, 120, alive=lambda: proc.poll() is None):
        raise RuntimeError(f"daemon not serving: {pathlib.Path(log.name).read_text()[-3000:]}")
    return proc, time.monotonic() - t0, log


def _resume(sock: str, sid: int, token: bytes, ids: list[int]):
    import grpc

    from kvcached_service import fdchannel
    from kvcached_service._generated.kvcached.v1 import kvcached_pb2 as pb
    from kvcached_service._generated.kvcached.v1 import kvcached_pb2_grpc as pb_grpc

    ch = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ch.connect(sock + ".fd")
    hello = fdchannel.recv_record(ch)
    t0 = time.monotonic()
    with grpc.insecure_channel(f"unix:{sock}") as gch:
        r = pb_grpc.KVCachedStub(gch).ResumeSession(pb.ResumeSessionRequest(
            channel_secret=hello.secret, session_id=sid, resume_token=token, page_ids=ids), timeout=300)
    took = time.monotonic() - t0
    return r, took, ch


def _own_start(log: pathlib.Path) -> float:
    """The daemon's own start, from its first log line to "serving on" (the
    journal read and the store's fds taken; without the process's exec and
    imports)."""
    import datetime

    stamps = []
    for line in log.read_text().splitlines():
        try:
            t = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
        except ValueError:
            continue
        stamps.append((t, line))
    first = stamps[0][0]
    serving = next(t for t, line in stamps if "kvcached: serving on" in line)
    return (serving - first).total_seconds()


def one(backend: str, store: str, pages: int) -> dict:
    from kvcached_service import fdchannel
    from kvcached_service.client import Client

    work = pathlib.Path(tempfile.mkdtemp(prefix=f"kvc-bench-resume-{store}-"))
    fake = None
    try:
        env = _env(backend, work, pages)
        if store == "systemd":
            fake = _fake_systemd()(work, pages + 1024)
            env.update(fake.env())
        sock = str(work / "kvc.sock")
        proc, _, log = _start(backend, work, store, pages, env, sock)
        c = Client.connect(sock, timeout=60)
        s = c.open_session("resume-bench")
        ids: list[int] = []
        for i in range(0, pages, 1000):  # in batches: this process's fds (hard limit 20,000 here) hold one at a time
            resp, fds = s.allocate_fds(min(1000, pages - i))
            fdchannel.close_fds(fds)  # nothing kept to re-send: every page must come from the store
            s._keeper.forget(s._keeper.seqs(resp.page_ids))  # nor the copies a resumable session keeps
            ids += resp.page_ids
        sid, token = s.id, s.resume_token
        s._closed = True  # this bench plays the client: no automatic resume
        if fake is not None:
            deadline = time.monotonic() + 60
            while len(fake.names()) < pages and time.monotonic() < deadline:
                time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        log.close()
        # both restarts go through the same exec shim (systemd's hand-over of the store's fds), with none for
        # the keeper, so the extra exec is in both starts alike
        shim = {"wrap": [PY, str(ROOT / "tests" / "listen_fds_exec.py"), "--"], "pass_fds": ()}
        proc, start_s, log = _start(backend, work, store, pages, env, sock, fake.start_args() if fake else shim)
        r, resume_s, ch = _resume(sock, sid, token, ids)
        own_s = _own_start(pathlib.Path(log.name))
        ch.close()
        c.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        log.close()
        return {"backend": backend, "store": store, "pages": pages, "adopted": r.pages_adopted,
                "start_s": start_s, "own_s": own_s, "resume_s": resume_s, "total_s": start_s + resume_s}
    finally:
        if fake is not None:
            fake.close()
        shutil.rmtree(work, ignore_errors=True)


def text(rows: list[dict]) -> str:
    out = [f"{'backend':<8} {'pages':>6} {'store':<8} {'adopted':>7} {'start s':>8} {'(own s)':>8} {'resume s':>9} {'total s':>8}"]
    for r in rows:
        out.append(f"{r['backend']:<8} {r['pages']:>6} {r['store']:<8} {r['adopted']:>7} {r['start_s']:8.2f} "
                   f"{r['own_s']:8.2f} {r['resume_s']:9.3f} {r['total_s']:8.2f}")
    by = {(r["backend"], r["pages"], r["store"]): r for r in rows}
    for (b, n, st), r in sorted(by.items()):
        k = by.get((b, n, "keeper"))
        if st == "systemd" and k:
            out.append(f"{b:<8} {n:>6} {'ratio':<8} {'':>7} {r['start_s'] / k['start_s']:8.2f} {r['own_s'] / k['own_s']:8.2f} "
                       f"{r['resume_s'] / k['resume_s']:9.2f} {r['total_s'] / k['total_s']:8.2f}   (systemd / keeper)")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.resume", description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("cuda", "host"), default="cuda", help="cuda = the CUDA test driver")
    ap.add_argument("--pages", default="1000,10000", help="comma-separated page counts")
    a = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # N page fds at once in this process and the fake store
    if a.backend == "cuda" and not TESTDRIVER.exists():
        print(f"bench.resume: {TESTDRIVER} is missing (scripts/build-testdriver.sh)", file=sys.stderr)
        return 2
    rows = []
    for n in (int(x) for x in a.pages.split(",")):
        for store in STORES:
            r = one(a.backend, store, n)
            print(f"  {a.backend} {n} pages via {store}: start {r['start_s']:.2f} s, resume {r['resume_s']:.3f} s", flush=True)
            rows.append(r)
    print(text(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
