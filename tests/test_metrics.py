"""Prometheus metrics: the exposition against GetStats, `promtool check
metrics` on it, a real Prometheus server scraping a real daemon, rpc
outcome counters and the Allocate histogram, session and reclaim counters,
NVML with a fake library, and start-up refusal on a busy metrics port.

Needs Debian's `prometheus` package (prometheus, promtool):
scripts/setup-ops.sh installs it."""

from __future__ import annotations

import json
import logging
import dataclasses
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
import urllib.parse
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcached_service import errors
from kvcached_service.server.ops.metrics import Metrics, Nvml
from kvcached_service.server.core.pool import Books, Budget

ROOT = pathlib.Path(__file__).resolve().parent.parent
MIB = 1 << 20


# ---- helpers (test_deploy.py uses them too) ---------------------------------
def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: run scripts/setup-ops.sh (Debian package for {name})")
    return path


def metrics_port(d) -> int:
    m = re.search(r"metrics on http://[^ ]*:(\d+)/metrics", d.log_text())
    assert m, "daemon did not log its metrics address:\n" + d.log_text()
    return int(m.group(1))


def start_with_metrics(daemon_factory, **settings):
    settings.setdefault("metrics_address", "127.0.0.1:0")
    return daemon_factory("host", **settings)


def scrape(d) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port(d)}/metrics", timeout=10) as r:
        assert r.status == 200
        return r.read().decode()


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(text: str, metric: str, **labels) -> float:
    v = samples(text).get((metric, frozenset(labels.items())))
    assert v is not None, f"no sample {metric}{labels} in:\n" + "\n".join(l for l in text.splitlines() if metric in l)
    return v


def names_in_exposition(text: str) -> set[str]:
    """Family names and sample names (with _total, _bucket, ...)."""
    out = set()
    for fam in text_string_to_metric_families(text):
        out.add(fam.name)
        out.update(s.name for s in fam.samples)
    for line in text.splitlines():  # families without samples still have HELP/TYPE
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            out.add(name)
            if kind == "counter":
                out.add(name if name.endswith("_total") else name + "_total")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeNvml:
    """The subset of pynvml Metrics uses: two GPUs."""

    def __init__(self):
        self.shutdowns = 0
        self.mem = {0: (80 * 2**30, 10 * 2**30, 70 * 2**30), 1: (24 * 2**30, 0, 24 * 2**30)}

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h:08d}-fake".encode()

    def nvmlDeviceGetMemoryInfo(self, h):
        t, u, f = self.mem[h]
        return types.SimpleNamespace(total=t, used=u, free=f)

    def nvmlShutdown(self):
        self.shutdowns += 1


def fake_daemon():
    """Just enough of Daemon for the collector (unit tests, no event loop)."""
    spec = types.SimpleNamespace(name="fake", kind="cuda", total_bytes=80 * 2**30)
    counters = types.SimpleNamespace(created_total=7, released_total=2, allocations_total=5, allocation_failures_total=1)
    books = Books(Budget("GPU-00000000-fake", 2 * MIB, 100), 5, 10, 85, counters.created_total, counters.released_total,
                  counters.allocations_total, counters.allocation_failures_total)
    pool = types.SimpleNamespace(page_size=2 * MIB, spec=spec, snapshot=books)
    pool.books = lambda: pool.snapshot  # the read model the collector uses
    sess = lambda sid, name, held: types.SimpleNamespace(  # noqa: E731
        id=sid, name=name, guaranteed_bytes=4 * MIB, max_bytes=0, reclaim_ignored=1, reclaim_requests=2,
        held_by_device={"GPU-00000000-fake": held})
    return types.SimpleNamespace(
        pools={"GPU-00000000-fake": pool},
        sessions={1: sess(1, "llama3:8b", 6), 2: sess(2, "llama3:8b", 4)},
        backend=types.SimpleNamespace(kind="cuda"),
        started_monotonic=time.monotonic() - 5,
        counters={"sessions_opened": 3, "sessions_closed": 1, "sessions_crashed": 0, "fd_channel_errors": 0},
        reclaimer=types.SimpleNamespace(requests_total=4, ignored_total=2, pages_asked_total=9, pages_returned_total=6,
                                        answers_total=1, requests_by_reason={"allocate": 3, "idle": 1}),
    )


# ---- the exposition -----------------------------------------------------------
def test_exposition_matches_getstats_and_passes_promtool(daemon_factory):
    d = start_with_metrics(daemon_factory, memory_limit="64MiB")
    with d.client() as c:
        a = c.open_session("llama3:8b", guaranteed_bytes=4 * MIB, max_bytes=32 * MIB)
        b = c.open_session("qwen2.5:7b")
        pa = a.allocate(5)
        b.allocate(3)
        a.free(pa[:2])  # 2 pages back to the pool
        time.sleep(0.2)
        st = c.stats()
        text = scrape(d)
        uuid, pool = next(iter(st.devices.items()))
        assert pool.pooled_bytes == 2 * 2 * MIB and pool.in_use_bytes == 6 * 2 * MIB  # the test's own premise
        for name, expected in [
            ("kvcached_device_budget_bytes", pool.budget_bytes),
            ("kvcached_device_in_use_bytes", pool.in_use_bytes),
            ("kvcached_device_pooled_bytes", pool.pooled_bytes),
            ("kvcached_device_free_bytes", pool.free_bytes),
            ("kvcached_device_page_size_bytes", pool.page_size),
            ("kvcached_device_pages_created_total", pool.pages_created_total),
            ("kvcached_device_pages_released_total", pool.pages_released_total),
        ]:
            assert value(text, name, device=uuid) == expected, name
        total = c.device(uuid).total_bytes
        assert value(text, "kvcached_device_total_bytes", device=uuid) == total
        assert value(text, "kvcached_session_held_bytes", session="llama3:8b", device=uuid) == 3 * 2 * MIB
        assert value(text, "kvcached_session_held_bytes", session="qwen2.5:7b", device=uuid) == 3 * 2 * MIB
        assert value(text, "kvcached_session_guaranteed_bytes", session="llama3:8b") == 4 * MIB
        assert value(text, "kvcached_session_max_bytes", session="llama3:8b") == 32 * MIB
        assert value(text, "kvcached_session_max_bytes", session="qwen2.5:7b") == 0
        assert value(text, "kvcached_sessions_open") == st.sessions_open == 2
        assert value(text, "kvcached_sessions_opened_total") == 2
        assert value(text, "kvcached_build_info", version=c.info.version, backend="host") == 1
        assert value(text, "kvcached_device_info", device=uuid, name=c.device(uuid).name, kind="host") == 1
        assert value(text, "process_open_fds") > 0  # every page is an fd: worth watching
        a.close()
        b.close()

    check = subprocess.run([tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True)
    assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), check.stdout + check.stderr
    # No NVML here: the gpu series are absent and nothing was logged above DEBUG about it.
    assert "kvcached_gpu_memory" not in text
    assert "nvml" not in d.log_text().lower()


def test_promtool_rejects_a_bad_exposition():
    """The promtool check above can fail: a counter without _total is a lint error."""
    bad = "# HELP kvcached_bad Bad.\n# TYPE kvcached_bad counter\nkvcached_bad 1\n"
    check = subprocess.run([tool("promtool"), "check", "metrics"], input=bad, capture_output=True, text=True)
    assert check.returncode != 0 and "_total" in check.stdout + check.stderr


def test_rpc_outcomes_and_allocate_histogram(daemon_factory):
    d = start_with_metrics(daemon_factory, memory_limit="16MiB")  # 8 pages
    with d.client() as c, c.open_session("counting") as s:
        held = [s.allocate(1) for _ in range(4)]
        with pytest.raises(errors.ResourceExhausted):
            s.allocate(100)  # above the budget: RESOURCE_EXHAUSTED
        with pytest.raises(errors.InvalidArgument):
            s.allocate_fds(0)
        with pytest.raises(errors.NotFound):
            s.free_ids([999999])
        s.free(held[0])
        s.free(held[1])
        text = scrape(d)
    assert value(text, "kvcached_rpc_requests_total", rpc="Allocate", code="OK") == 4
    assert value(text, "kvcached_rpc_requests_total", rpc="Allocate", code="RESOURCE_EXHAUSTED") == 1
    assert value(text, "kvcached_rpc_requests_total", rpc="Allocate", code="INVALID_ARGUMENT") == 1
    assert value(text, "kvcached_rpc_requests_total", rpc="Free", code="OK") == 2
    assert value(text, "kvcached_rpc_requests_total", rpc="Free", code="NOT_FOUND") == 1
    assert value(text, "kvcached_rpc_requests_total", rpc="OpenSession", code="OK") == 1
    assert value(text, "kvcached_allocate_duration_seconds_count", wait="false") == 6
    assert value(text, "kvcached_allocate_duration_seconds_bucket", wait="false", le="+Inf") == 6
    assert 0 < value(text, "kvcached_allocate_duration_seconds_sum", wait="false") < 5
    assert value(text, "kvcached_allocate_duration_seconds_count", wait="true") == 0


def test_each_page_request_is_counted_once_whichever_transport(daemon_factory):
    """Allocate, Free and CloseSession are observed by the core at its
    boundary, once, whether they came as fd channel requests (the client) or
    as gRPC calls (tools); the gRPC interceptor does not count them again.
    A gRPC Allocate whose body cannot be decoded never reaches the core and
    is still counted, once."""
    import grpc

    from helpers.raw import stub
    from kvcached_service._generated.kvcached.v1 import kvcached_pb2 as pb

    from kvcached_service import fdchannel

    d = start_with_metrics(daemon_factory, memory_limit="16MiB", grpc_page_ops=True)
    with d.client() as c, c.open_session("channel") as s:
        s.free(s.allocate(1))  # over the fd channel
        # a tool's session: its own fd channel, page rpcs over gRPC
        rpc = stub(d)
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        raw.connect(d.fd_socket)
        raw.settimeout(10)
        hello = fdchannel.recv_record(raw)
        tool = rpc.OpenSession(pb.OpenSessionRequest(channel_secret=hello.secret, name="tool"), timeout=10).session
        resp = rpc.Allocate(pb.AllocateRequest(session=tool, num_pages=1), timeout=10)
        fdchannel.close_fds(fdchannel.recv_record(raw).fds)
        rpc.Free(pb.FreeRequest(session=tool, page_ids=list(resp.page_ids)), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            rpc.Allocate(pb.AllocateRequest(session=pb.SessionRef(id=s.id, token=b"x" * 32), num_pages=1), timeout=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        garbage = c._rpc._channel.unary_unary("/kvcached.v1.KVCached/Allocate")
        with pytest.raises(grpc.RpcError) as info:
            garbage(b"\xff\xff\xff", timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        text = scrape(d)
    assert value(text, "kvcached_rpc_requests_total", rpc="Allocate", code="OK") == 2
    assert value(text, "kvcached_rpc_requests_total", rpc="Free", code="OK") == 2
    assert value(text, "kvcached_rpc_requests_total", rpc="Allocate", code="PERMISSION_DENIED") == 1
    assert value(text, "kvcached_rpc_requests_total", rpc="Allocate", code="INVALID_ARGUMENT") == 1
    assert value(text, "kvcached_allocate_duration_seconds_count", wait="false") == 4
    assert value(text, "kvcached_rpc_requests_total", rpc="OpenSession", code="OK") == 2  # the interceptor's
    raw.close()


def test_session_and_reclaim_counters(daemon_factory):
    d = start_with_metrics(daemon_factory, memory_limit="32MiB", reclaim_timeout_ms=200)
    with d.client() as c:
        admin = c.open_session("admin")
        stubborn = c.open_session("stubborn")
        stubborn.allocate(6)
        assert admin.request_shrink(stubborn.id, 2 * 2 * MIB, timeout_ms=200) == 4
        closed = c.open_session("closed")
        closed.close()
        # a client process that dies without closing its session
        code = (
            "import os; from kvcached_service.client import Client; "
            f"s = Client.connect({d.socket!r}).open_session('crasher'); s.allocate(1); os._exit(0)"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
        deadline = time.monotonic() + 5
        while True:
            text = scrape(d)
            if (value(text, "kvcached_reclaim_ignored_total") >= 1 and value(text, "kvcached_sessions_crashed_total") >= 1) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert value(text, "kvcached_reclaim_requests_total") == 1
        assert value(text, "kvcached_reclaim_asked_pages_total") == 4
        assert value(text, "kvcached_reclaim_ignored_total") == 1
        assert value(text, "kvcached_session_reclaim_ignored", session="stubborn") == 1
        assert value(text, "kvcached_sessions_opened_total") == 4
        assert value(text, "kvcached_sessions_closed_total") == 1
        assert value(text, "kvcached_sessions_crashed_total") == 1
        assert value(text, "kvcached_fd_channel_errors_total") == 0
        assert value(text, "kvcached_sessions_open") == 2
        admin.close()
        stubborn.close()


def test_collector_reads_live_state_and_nvml_with_a_fake_library():
    daemon = fake_daemon()
    fake = FakeNvml()
    m = Metrics(daemon, nvml=Nvml(loader=lambda: fake), process=False)
    text = m.text().decode()
    uuid = "GPU-00000000-fake"
    assert value(text, "kvcached_gpu_memory_total_bytes", device=uuid) == 80 * 2**30
    assert value(text, "kvcached_gpu_memory_used_bytes", device=uuid) == 10 * 2**30
    assert value(text, "kvcached_gpu_memory_free_bytes", device="GPU-00000001-fake") == 24 * 2**30
    assert value(text, "kvcached_device_in_use_bytes", device=uuid) == 20 * MIB
    # sessions sharing a name are summed, so the label set stays bounded and unique
    assert value(text, "kvcached_session_held_bytes", session="llama3:8b", device=uuid) == 10 * 2 * MIB
    assert value(text, "kvcached_session_open", session="llama3:8b") == 2
    # values are read at scrape time: change the daemon, scrape again
    pool = daemon.pools[uuid]
    pool.snapshot = dataclasses.replace(pool.snapshot, in_use=42, free=53)
    daemon.sessions.pop(2)
    fake.mem[0] = (80 * 2**30, 30 * 2**30, 50 * 2**30)
    text = m.text().decode()
    assert value(text, "kvcached_device_in_use_bytes", device=uuid) == 42 * 2 * MIB
    assert value(text, "kvcached_session_held_bytes", session="llama3:8b", device=uuid) == 6 * 2 * MIB
    assert value(text, "kvcached_gpu_memory_used_bytes", device=uuid) == 30 * 2**30
    m.stop()
    assert fake.shutdowns == 1


def test_nvml_missing_is_one_debug_line_and_no_series(caplog):
    calls = []

    def broken():
        calls.append(1)
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    with caplog.at_level(logging.DEBUG, logger="kvcached.metrics"):
        m = Metrics(fake_daemon(), nvml=Nvml(loader=broken), process=False)
        for _ in range(3):
            text = m.text().decode()
    assert "kvcached_gpu_memory" not in text
    assert len(calls) == 1, "NVML must be tried once, not per scrape"
    nvml_lines = [r for r in caplog.records if "NVML" in r.getMessage()]
    assert len(nvml_lines) == 1 and nvml_lines[0].levelno == logging.DEBUG


def test_two_registries_do_not_share_state():
    a = Metrics(fake_daemon(), nvml=Nvml(loader=FakeNvml), process=False)
    b = Metrics(fake_daemon(), nvml=Nvml(loader=FakeNvml), process=False)
    a.rpc.observe("Allocate", None, 0.001)
    assert value(a.text().decode(), "kvcached_rpc_requests_total", rpc="Allocate", code="OK") == 1
    assert value(b.text().decode(), "kvcached_rpc_requests_total", rpc="Allocate", code="OK") == 0


def test_busy_metrics_port_refuses_to_start(daemon_factory):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        d = daemon_factory("host", wait=False, metrics_address=f"127.0.0.1:{port}")
        rc = d.proc.wait(30)
    assert rc == 1, d.log_text()
    assert f"metrics_address 127.0.0.1:{port}: cannot listen" in d.log_text()
    assert not os.path.exists(d.socket)
    assert not os.path.exists(d.socket + ".fd")  # every exit path the daemon controls removes both (issue 28)


# ---- a real Prometheus server -------------------------------------------------
def prom_query(base: str, query: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_real_prometheus_scrapes_the_daemon(daemon_factory, tmp_path):
    d = start_with_metrics(daemon_factory, memory_limit="64MiB")
    target = f"127.0.0.1:{metrics_port(d)}"
    web = f"127.0.0.1:{free_port()}"
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files:\n  - {ROOT / 'deploy/prometheus/kvcached-rules.yml'}\n"
        "scrape_configs:\n  - job_name: kvcached\n    static_configs:\n"
        f"      - targets: ['{target}']\n"
    )
    log = open(tmp_path / "prometheus.log", "w")
    prom = subprocess.Popen(
        [tool("prometheus"), f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address={web}"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    base = f"http://{web}"
    try:
        with d.client() as c, c.open_session("llama3:8b") as s1, c.open_session("phi3") as s2:
            s1.allocate(7)
            p2 = s2.allocate(4)
            s2.free(p2[:1])
            st = c.stats()
            uuid, pool = next(iter(st.devices.items()))
            # Wait until Prometheus has scraped the daemon in this state.
            deadline = time.monotonic() + 60
            got = []
            while time.monotonic() < deadline:
                assert prom.poll() is None, (tmp_path / "prometheus.log").read_text()
                try:
                    got = prom_query(base, 'kvcached_session_held_bytes{session="phi3"}')
                    if got and float(got[0]["value"][1]) == 3 * 2 * MIB:
                        break
                except OSError:
                    pass
                time.sleep(0.3)
            else:
                pytest.fail(f"Prometheus never saw the state; last answer {got}\n" + (tmp_path / "prometheus.log").read_text())

            def one(q: str) -> float:
                res = prom_query(base, q)
                assert len(res) == 1, (q, res)
                return float(res[0]["value"][1])

            assert one('up{job="kvcached"}') == 1
            assert one(f'kvcached_device_budget_bytes{{device="{uuid}"}}') == pool.budget_bytes
            assert one(f'kvcached_device_in_use_bytes{{device="{uuid}"}}') == pool.in_use_bytes == 10 * 2 * MIB
            assert one(f'kvcached_device_pooled_bytes{{device="{uuid}"}}') == pool.pooled_bytes
            assert one(f'kvcached_device_free_bytes{{device="{uuid}"}}') == pool.free_bytes
            assert one(f'kvcached_session_held_bytes{{session="llama3:8b",device="{uuid}"}}') == 7 * 2 * MIB
            assert one("kvcached_sessions_open") == st.sessions_open == 2
            # the books add up in what Prometheus stored, too
            assert one("kvcached_device_pooled_bytes + kvcached_device_in_use_bytes + kvcached_device_free_bytes - kvcached_device_budget_bytes") == 0
            assert one('sum(kvcached_rpc_requests_total{rpc="Allocate",code="OK"})') == 2
            # the shipped alert rules load and evaluate against the live series
            with urllib.request.urlopen(f"{base}/api/v1/rules", timeout=5) as r:
                rules = json.load(r)["data"]["groups"]
            names = {rule["name"] for g in rules for rule in g["rules"]}
            assert {"KvcachedDown", "KvcachedPoolExhausted", "KvcachedReclaimIgnored", "KvcachedAllocateLatencyHigh"} <= names
            assert all(rule["health"] != "err" for g in rules for rule in g["rules"]), rules
    finally:
        prom.send_signal(signal.SIGTERM)
        try:
            prom.wait(20)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()
        log.close()


def test_rpc_metrics_counts_and_buckets_kept_as_plain_numbers():
    """The rpc counter and the Allocate histogram are kept by RpcMetrics
    itself (no prometheus-client lock per observation) and exposed at
    scrape time: the series exist at 0 from the start, codes are named, a
    latency equal to a bucket's bound counts in that bucket (`le`), buckets
    are cumulative, and waited / not waited are apart."""
    m = Metrics(fake_daemon(), nvml=Nvml(loader=FakeNvml), process=False)
    text = m.text().decode()
    assert value(text, "kvcached_rpc_requests_total", rpc="Allocate", code="OK") == 0
    assert value(text, "kvcached_rpc_requests_total", rpc="Free", code="OK") == 0
    for w in ("false", "true"):
        assert value(text, "kvcached_allocate_duration_seconds_count", wait=w) == 0
    m.rpc.observe_op("Allocate", None, 0.001, False)        # exactly on the 0.001 bound
    m.rpc.observe_op("Allocate", errors.Code.OK, 0.0011, False)
    m.rpc.observe_op("Allocate", errors.Code.RESOURCE_EXHAUSTED, 7.0, True)
    m.rpc.observe_op("Free", errors.Code.NOT_FOUND, 0.5, False)
    m.rpc.observe("GetStats", None, 0.2)
    text = m.text().decode()
    assert value(text, "kvcached_rpc_requests_total", rpc="Allocate", code="OK") == 2
    assert value(text, "kvcached_rpc_requests_total", rpc="Allocate", code="RESOURCE_EXHAUSTED") == 1
    assert value(text, "kvcached_rpc_requests_total", rpc="Free", code="NOT_FOUND") == 1
    assert value(text, "kvcached_rpc_requests_total", rpc="GetStats", code="OK") == 1
    b = lambda le, w="false": value(text, "kvcached_allocate_duration_seconds_bucket", wait=w, le=le)  # noqa: E731
    assert (b("0.0005"), b("0.001"), b("0.0025"), b("+Inf")) == (0, 1, 2, 2)
    assert (b("5.0", "true"), b("10.0", "true"), b("+Inf", "true")) == (0, 1, 1)
    assert value(text, "kvcached_allocate_duration_seconds_count", wait="false") == 2
    assert value(text, "kvcached_allocate_duration_seconds_sum", wait="false") == pytest.approx(0.0021)
    assert value(text, "kvcached_allocate_duration_seconds_sum", wait="true") == pytest.approx(7.0)
