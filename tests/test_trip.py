"""The trip of one fd channel Allocate, from the Python client's Region.map
to a mapped page (host backend, and the CUDA backend on the test driver),
traced in both processes:

- the client: sys.setprofile on the thread that calls Region.map (it is
  also the thread that reads its answer: client/channel.py);
- the daemon: tests/helpers/traced_serve.py runs kvcached-serve with its
  fd channel read callback under sys.setprofile (one record per callback;
  a one-page Allocate from the warm pool is served inside it, no Task).

A file is *entered* when a function of it is called from another file. The
trip is the sequence of entries; an *upcall* is an entry into a file, or
into a layer (LAYERS) from another layer, that is already on the call stack
(a lower layer calling back into a higher one).
The layers are read from docs/architecture.md (the table under "One
page's trip"). Four trips are traced: host and CUDA, warm pool and cold
(traced_serve follows a cold Allocate to the device worker and back until
its REPLY), each counted in layers and cross-file calls and held at or
below the counts measured before issue 47's work on them
(`test_every_trip_is_counted_and_grows_no_further`).
The bar for the warm trips: at most 8 layers, every file in a named layer,
no upcall. It is met on both backends (`test_the_trip_meets_the_bar`, and the CUDA test,
which also checks that the daemon enters no backend and no driver binding
on a warm Allocate), and
`test_the_trip_is_the_one_documented` holds the trip to the list in
docs/architecture.md ("One page's trip"), so a new file or upcall on the
way fails it and the doc stays true.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from kvtest import HELPERS, PY, ROOT, Daemon, testdriver_env, wait_serving, wait_until

MiB = 1 << 20

ARCHITECTURE = ROOT / "docs" / "architecture.md"


def read_layers(text: str) -> dict[str, str]:
    """file -> layer, from the table under "### One page's trip" in
    docs/architecture.md (the one list of the layers)."""
    section = text.split("### One page's trip", 1)[1]
    out: dict[str, str] = {}
    for line in section.splitlines():
        m = re.match(r"^\| ([A-Za-z ]+) \| (`[^|]+`) \|$", line)
        if m:
            for f in re.findall(r"`([^`]+)`", m.group(2)):
                out["kvcached_service/" + f] = m.group(1)
        elif out and not line.startswith("|"):
            break  # the table's end
    return out


LAYERS = read_layers(ARCHITECTURE.read_text())  # file -> the named layer it is


def _recorder():
    spec = importlib.util.spec_from_file_location("traced_serve", HELPERS / "traced_serve.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.recorder


def _layer(path: str) -> str:
    return LAYERS.get(path, path)


def entries(calls: list) -> list[tuple[str, str, bool]]:
    """(file, function, upcall) for each call that enters a file from
    another one, in order. `calls` holds [depth, file, function, caller's
    file, the package's files on the stack below it] (traced_serve.recorder).
    An upcall enters a file already on the stack, or a layer already on the
    stack from another layer (the core calling its own books is no upcall;
    the pool calling them would be)."""
    out = []
    for _depth, path, fn, caller, below in calls:  # below: the package's files on the stack (the recorder's)
        if path != caller:
            layer = _layer(path)
            up = path in below or (_layer(caller) != layer and any(_layer(f) == layer for f in below))
            out.append((path, fn, up))
    return out


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """trips(backend, pool): the entries of one Region.map of one page,
    (client's, daemon's), on a warm pool (--prealloc) or a cold one (the
    page made for the Allocate on the device worker); each traced once."""
    done: dict = {}

    def get(backend: str, pool: str = "warm"):
        if (backend, pool) not in done:
            done[backend, pool] = _trace(tmp_path_factory.mktemp(f"trip-{backend}-{pool}"), backend, pool == "warm")
        return done[backend, pool]

    return get


@pytest.fixture
def trip(traced):
    """Host backend, warm pool."""
    return traced("host")


@pytest.fixture
def cuda_trip(traced):
    """The CUDA backend (the test driver, or KVCACHED_TEST_LIBCUDA), warm pool."""
    return traced("cuda")


def _trace(tmp, backend: str, warm: bool = True):
    sock, log, trace = str(tmp / "kvc.sock"), tmp / "daemon.log", tmp / "trip.jsonl"
    extra = testdriver_env() if backend == "cuda" else {}
    env = dict(os.environ, **extra, KVCACHED_TRIP_LOG=str(trace), PYTHONPATH=str(ROOT))
    with open(log, "w") as logf:
        proc = subprocess.Popen([PY, str(HELPERS / "traced_serve.py"), "--socket", sock, "--backend", backend,
                                 "--memory-limit", "64MiB", "--prealloc", "8MiB" if warm else "0", "--shutdown-grace", "0.5"],
                                env=env, stdout=logf, stderr=subprocess.STDOUT)
    d = Daemon(proc, sock, log, extra, None)
    try:
        wait_serving(sock, proc, log)
        calls: list = []
        with d.client() as c, c.open_session("trip") as s, s.region(4 * MiB) as r:
            trace.write_text("")  # from here: the Allocate's records only
            gc.disable()  # a collection's finalizers (grpc channels, hypothesis's callback) are no step of the trip
            sys.setprofile(_recorder()(calls))
            try:
                r.map(0, 2 * MiB)
            finally:
                sys.setprofile(None)
                gc.enable()
            # the daemon writes a callback's calls once it returns, after its REPLY
            wait_until(lambda: "Daemon.lend" in (t := trace.read_text()) and t.endswith("\n"), 5)
            served = [json.loads(line) for line in trace.read_text().splitlines()]
            r.write(0, b"trip")
            assert r.read(0, 4) == b"trip" and r.read(4, 16) == bytes(16)  # a mapped page, zeroed
    finally:
        assert d.stop() == 0, d.log_text()
    allocate = [seg for seg in served if any(fn == "Daemon.lend" for _, _, fn, *_ in seg)]
    assert len(allocate) == 1, served
    return entries(calls), entries(allocate[0])


def test_the_allocate_is_served_in_one_pass_and_ends_in_a_mapped_page(trip):
    client, daemon = trip
    c = [f"{p}:{fn}" for p, fn, _ in client]
    assert c[0] == "kvcached_service/client/region.py:Region.map"
    assert c[-1] == "kvcached_service/client/mapping.py:Mapper.map_run"  # the page mapped after the answer
    d = [f"{p}:{fn}" for p, fn, _ in daemon]
    # one read callback: the request decoded, lent, booked, PAGES sent, REPLY sent
    assert d[0] == "kvcached_service/server/transports/channel.py:ChannelServer._read_one"
    steps = ("kvcached_service/fdchannel.py:recv_request", "kvcached_service/server/core/daemon.py:Daemon.lend",
             "kvcached_service/server/core/pool/device.py:DevicePool.lend", "kvcached_service/server/core/sessions.py:Session.book_loan",
             "kvcached_service/fdchannel.py:send_answer")
    for step in steps:
        assert step in d, (step, d)
    # in this order: the pages are the session's before any PAGES record carries them
    assert [d.index(step) for step in steps] == sorted(d.index(step) for step in steps), d


def _show(client, daemon) -> str:
    return "\n".join(["trip (client, then daemon):"]
                     + [f"  {p}:{fn}{' (upcall)' if up else ''}" for p, fn, up in client + daemon])


def test_the_cuda_trip_meets_the_bar_and_the_daemon_makes_no_driver_call(cuda_trip):
    """On the CUDA backend the client's side adds the CUDA mapper and the
    driver binding (import, map, set access: the client's own driver work),
    and the daemon's side is the host's: a warm Allocate sends each page's
    kept export, so the daemon enters neither a backend nor the driver
    binding between the request and its reply (issue 42 item 2)."""
    client, daemon = cuda_trip
    files = {p for p, _, _ in client + daemon}
    layers = {LAYERS.get(p) for p in files}
    upcalls = [f"{p}:{fn}" for p, fn, up in client + daemon if up]
    unnamed = sorted(p for p in files if p not in LAYERS)
    print(f"\ncuda trip: {len(files)} files, {len(layers)} layers, {len(upcalls)} upcalls, "
          f"{len(client) + len(daemon)} cross-file calls")
    assert len(layers) <= 8 and not unnamed and not upcalls, _show(client, daemon)
    c = {p for p, _, _ in client}
    assert {"kvcached_service/client/cuda_mapper.py", "kvcached_service/cuda/driver.py"} <= c, _show(client, daemon)
    d = {p for p, _, _ in daemon}
    assert not {p for p in d if LAYERS.get(p) in ("backend", "driver binding")}, _show(client, daemon)


def test_the_trip_meets_the_bar(trip):
    """At most 8 layers, every file of the trip in a named layer, no upcall.
    (Issue 26's bar counted files, at most 10; the pool is a package of
    parts now, server/core/pool/, one layer of several files: the bar counts what
    a reader crosses, the layers.)"""
    client, daemon = trip
    files = {p for p, _, _ in client + daemon}
    layers = {LAYERS.get(p) for p in files}
    upcalls = [f"{p}:{fn}" for p, fn, up in client + daemon if up]
    unnamed = sorted(p for p in files if p not in LAYERS)
    print(f"\ntrip: {len(files)} files, {len(layers)} layers, {len(unnamed)} no named layer, "
          f"{len(upcalls)} upcalls, {len(client) + len(daemon)} cross-file calls")
    assert len(layers) <= 8 and not unnamed and not upcalls, _show(client, daemon)


# docs/architecture.md, "One page's trip": the files entered, in their order
TRIP_FILES = [
    "kvcached_service/client/region.py", "kvcached_service/client/client.py", "kvcached_service/client/channel.py",
    "kvcached_service/fdchannel.py", "kvcached_service/client/mapping.py",
    "kvcached_service/server/transports/channel.py", "kvcached_service/server/core/daemon.py", "kvcached_service/server/core/pool/device.py",
    "kvcached_service/server/core/pool/books.py", "kvcached_service/server/core/pool/pages.py", "kvcached_service/server/core/sessions.py",
]


def test_the_trip_is_the_one_documented(trip):
    client, daemon = trip
    files = list(dict.fromkeys(p for p, _, _ in client + daemon))  # each file where the trip first enters it
    assert files == TRIP_FILES, _show(client, daemon)


# Every trip counted: cross-file calls (client and daemon together) and
# layers, as measured after issue 47 item 5's changes (docs/architecture.md,
# "What a trip costs", has the counts before them: 24/31/31/50 calls). A
# trip may not grow past these. Issue 47's budget, at most 16 calls and 8
# layers: every trip is within the layers, the warm trips within the calls;
# the cold ones are not (a page made for the Allocate adds the worker, the
# backend and, on CUDA, the backend's driver calls: see the doc).
TRIP_COUNTS = {  # (backend, pool) -> (cross-file calls, layers)
    ("host", "warm"): (15, 6),
    ("host", "cold"): (23, 7),
    ("cuda", "warm"): (16, 7),
    ("cuda", "cold"): (36, 8),
}
BUDGET_CALLS, BUDGET_LAYERS = 16, 8


def test_the_counts_meet_the_budget_where_the_doc_says():
    """The held counts: every trip within 8 layers, the warm trips (the
    request path of a pool with ready pages) within 16 calls."""
    assert all(layers <= BUDGET_LAYERS for _, layers in TRIP_COUNTS.values()), TRIP_COUNTS
    assert all(TRIP_COUNTS[b, "warm"][0] <= BUDGET_CALLS for b in ("host", "cuda")), TRIP_COUNTS


@pytest.mark.parametrize("backend,pool", sorted(TRIP_COUNTS))
def test_every_trip_is_counted_and_grows_no_further(traced, backend, pool):
    client, daemon = traced(backend, pool)
    files = {p for p, _, _ in client + daemon}
    layers = {LAYERS.get(p) for p in files}
    upcalls = [f"{p}:{fn}" for p, fn, up in client + daemon if up]
    unnamed = sorted(p for p in files if p not in LAYERS)
    calls = len(client) + len(daemon)
    print(f"\n{backend} {pool} trip: {calls} cross-file calls (client {len(client)}, daemon {len(daemon)}), "
          f"{len(layers)} layers, {len(files)} files, {len(upcalls)} upcalls")
    print(_show(client, daemon))
    assert not unnamed and not upcalls, _show(client, daemon)
    most_calls, most_layers = TRIP_COUNTS[backend, pool]
    assert calls <= most_calls and len(layers) <= most_layers, (calls, len(layers), _show(client, daemon))
