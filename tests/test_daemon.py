"""The daemon as users meet it: start-up, health, reflection, socket files,
allocation, stats and shutdown."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvtest import PY, SERVE, assert_books, wait_until, watch_in_background
from kvcached_service import errors


def test_health_serving_and_reflection_lists_service(daemon):
    with grpc.insecure_channel(f"unix:{daemon.socket}") as ch:
        for service in ("", "kvcached.v1.KVCached"):
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        answers = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        names = {s.name for s in answers[0].list_services_response.service}
        assert "kvcached.v1.KVCached" in names
        assert "grpc.health.v1.Health" in names


def test_getinfo_describes_devices(daemon, backend):
    with daemon.client() as c:
        assert c.info.api_version == 1
        assert c.info.fd_socket == daemon.fd_socket
        assert c.info.backend == backend
        (dev,) = c.devices
        assert dev.kind == backend
        assert dev.page_size == 2 << 20
        assert dev.budget_bytes == 256 << 20
        assert dev.page_size % dev.granularity == 0
        if backend == "cuda":
            assert dev.uuid.startswith("GPU-")
        else:
            assert dev.uuid == "HOST-0"


def test_socket_files_have_configured_mode(daemon_factory, tmp_path):
    d = daemon_factory("host", socket_mode="0600")
    for path in (d.socket, d.fd_socket):
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o600


def test_default_socket_mode_is_0660(host_daemon):
    assert stat.S_IMODE(os.stat(host_daemon.socket).st_mode) == 0o660
    assert stat.S_IMODE(os.stat(host_daemon.fd_socket).st_mode) == 0o660


def test_socket_group_applied(daemon_factory):
    import grp

    group = grp.getgrgid(os.getgid()).gr_name
    d = daemon_factory("host", socket_group=group)
    assert os.stat(d.socket).st_gid == os.getgid()


def test_allocate_write_read_free_and_books(daemon):
    with daemon.client() as c, c.open_session("t") as s:
        pages = s.allocate(8)
        assert len({p.id for p in pages}) == 8
        for i, p in enumerate(pages):
            assert p.read(0, 4096) == bytes(4096), "a fresh page must read as zeros"
            p.write(0, bytes([i + 1]) * 4096)
        for i, p in enumerate(pages):
            assert p.read(0, 4096) == bytes([i + 1]) * 4096
        st = s.stats()
        assert_books(st)
        assert st.total.in_use_bytes == 8 * (2 << 20)
        me = s.my_stats()
        assert me.pages_held == 8 and me.held_bytes == 8 * (2 << 20)
        s.free(pages)
        st = s.stats()
        assert_books(st)
        assert st.total.in_use_bytes == 0
        assert st.total.pooled_bytes == 8 * (2 << 20)


def test_allocation_over_253_pages_spans_several_records(daemon_factory, backend):
    d = daemon_factory(backend, memory_limit="1GiB", page_size="2MiB")
    with d.client() as c, c.open_session("big") as s:
        pages = s.allocate(300)
        assert len(pages) == 300
        pages[299].write(0, b"last")
        assert pages[299].read(0, 4) == b"last"
        s.free(pages)


def test_session_stats_visibility(host_daemon):
    with host_daemon.client() as c, c.open_session("a") as a, c.open_session("b") as b:
        assert c.stats().sessions == []  # no session: global numbers only
        # Sessions of root are admin sessions here (uid 0 is in admin_uids by default)
        assert {s.id for s in a.stats().sessions} == {a.id, b.id}


def test_stale_socket_is_replaced(daemon_factory, tmp_path):
    path = tmp_path / "kvc0.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()  # a socket file nobody listens on
    d = daemon_factory("host")
    assert d.socket == str(path)
    with d.client() as c:
        assert c.info.api_version == 1


def test_refuses_to_start_when_another_daemon_listens(daemon_factory, tmp_path):
    first = daemon_factory("host")
    proc = subprocess.run(
        SERVE + ["--socket", first.socket, "--backend", "host", "--memory-limit", "64MiB"],
        capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode == 1
    assert "another daemon is listening" in proc.stderr
    with first.client() as c:  # the first one is unharmed
        assert c.info.api_version == 1


def test_refuses_to_replace_a_non_socket(tmp_path):
    path = tmp_path / "file.sock"
    path.write_text("precious")
    proc = subprocess.run(SERVE + ["--socket", str(path), "--backend", "host"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    assert "is not a socket" in proc.stderr
    assert path.read_text() == "precious"


def test_sigterm_drains_tells_watchers_and_removes_sockets(daemon):
    c = daemon.client()
    s = c.open_session("watcher")
    pages = s.allocate(3)
    events, done = watch_in_background(s)
    assert wait_until(lambda: events and events[0].kind == "READY")
    daemon.proc.send_signal(signal.SIGTERM)
    assert done.wait(10), "Watch stream did not end at shutdown"
    kinds = [getattr(e, "kind", None) for e in events]
    assert "SHUTDOWN" in kinds, events
    assert daemon.proc.wait(20) == 0
    assert not os.path.exists(daemon.socket) and not os.path.exists(daemon.fd_socket)
    assert "stopped: every page released" in daemon.log_text()
    del pages
    c.close()


def test_auto_backend_falls_back_to_host_and_says_so(daemon_factory):
    d = daemon_factory("auto", env={"KVCACHED_LIBCUDA": "/nonexistent/libcuda.so.1"})
    with d.client() as c:
        assert c.info.backend == "host"
    assert "backend: host (memfd pages): no usable CUDA driver" in d.log_text()


def test_cuda_backend_without_driver_exits_nonzero_with_reason(tmp_path):
    env = dict(os.environ, KVCACHED_LIBCUDA="/nonexistent/libcuda.so.1")
    proc = subprocess.run(
        SERVE + ["--socket", str(tmp_path / "x.sock"), "--backend", "cuda"], capture_output=True, text=True, timeout=30, env=env
    )
    assert proc.returncode == 1
    assert "--backend cuda: the CUDA driver is not usable" in proc.stderr
    assert "/nonexistent/libcuda.so.1" in proc.stderr


def test_prealloc_creates_warm_pages(daemon_factory, backend):
    d = daemon_factory(backend, prealloc="16MiB")
    with d.client() as c:
        st = c.stats()
        assert st.total.pages_pooled == 8
        assert st.total.pages_created_total == 8
        assert_books(st)
        with c.open_session("warm") as s:
            s.allocate(8)
            st = c.stats()
            assert st.total.pages_in_use == 8
            # taken from the warm pool, which then refills in the background
            assert wait_until(lambda: c.stats().total.pages_pooled == 8)


def test_idle_pool_pages_return_to_backend(daemon_factory):
    d = daemon_factory("host", pool_idle_seconds="0.3")
    with d.client() as c, c.open_session("t") as s:
        s.free(s.allocate(4))
        assert c.stats().total.pages_pooled == 4
        assert wait_until(lambda: c.stats().total.pages_pooled == 0, timeout=5)
        st = c.stats()
        assert st.total.pages_released_total == 4
        assert st.total.free_bytes == st.total.budget_bytes


def test_print_config_shows_resolved_settings(tmp_path):
    cfg = tmp_path / "k.toml"
    cfg.write_text('memory_limit = "1GiB"\npage_size = "4MiB"\n')
    env = dict(os.environ, KVCACHED_PAGE_SIZE="8MiB")
    out = subprocess.run(
        SERVE + ["--config", str(cfg), "--print-config", "--socket", "/tmp/x.sock"], capture_output=True, text=True, env=env, check=True
    ).stdout
    got = json.loads(out)
    assert got["memory_limit"] == "1GiB"  # from the file
    assert got["page_size"] == "8MiB"  # env beats file
    assert got["socket"] == "/tmp/x.sock" and got["fd_socket"] == "/tmp/x.sock.fd"  # flag


def test_invalid_setting_fails_at_start_naming_it(tmp_path):
    proc = subprocess.run(SERVE + ["--memory-limit", "lots", "--socket", str(tmp_path / "s")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "memory_limit" in proc.stderr and "not a size" in proc.stderr


def test_page_size_must_be_multiple_of_granularity(tmp_path):
    proc = subprocess.run(
        SERVE + ["--backend", "host", "--page-size", "5000", "--socket", str(tmp_path / "s")], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 1
    assert "not a multiple" in proc.stderr and "granularity" in proc.stderr


def test_sighup_reloads_what_it_can_and_never_kills(daemon_factory, tmp_path):
    """Issue 28: SIGHUP killed the daemon at once, like a crash, leaving its
    socket files behind. Now it re-reads the settings (the --config file as
    it is now): the reloadable ones apply at once (log level, limits), the
    others are named as needing a restart and kept; an invalid file is
    named and changes nothing; without changes it says so. The daemon
    serves throughout, and a SIGTERM afterwards exits 0 and removes both
    socket files."""
    import signal

    cfg = tmp_path / "k.toml"
    cfg.write_text('log_level = "INFO"\nmax_sessions_per_uid = 8\n')
    d = daemon_factory("host", config=str(cfg))
    with d.client() as c:
        s1 = c.open_session("before")
        cfg.write_text('log_level = "DEBUG"\nmax_sessions_per_uid = 2\npage_size = "4MiB"\n')
        d.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: "SIGHUP: settings reloaded" in d.log_text(), timeout=5), d.log_text()
        assert "log_level 'INFO' -> 'DEBUG', max_sessions_per_uid 8 -> 2; changed but need a restart (kept): page_size" in d.log_text()
        s2 = c.open_session("second")
        with pytest.raises(errors.ResourceExhausted, match=r"max_sessions_per_uid=2"):
            c.open_session("third")  # the new limit applies at once
        cfg.write_text('max_sessions_per_uid = "many"\n')
        d.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: "SIGHUP: not reloaded, the running settings stay" in d.log_text(), timeout=5)
        assert "max_sessions_per_uid" in d.log_text().split("SIGHUP: not reloaded")[1]
        s2.close()
        s1.free(s1.allocate(2))  # served throughout
        assert d.proc.poll() is None
        s1.close()
    assert "DEBUG" in d.log_text()  # the new level took effect
    assert d.stop() == 0
    assert not os.path.exists(d.socket) and not os.path.exists(d.socket + ".fd")
