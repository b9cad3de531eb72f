"""Unit tests: settings, the error taxonomy, fd channel framing, generated
code freshness, and the pool's accounting with a fake backend."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import grpc
import pytest

from kvtest import ROOT
from kvcached_service import errors, fdchannel
from kvcached_service.backends.base import Backend, DeviceSpec, PageHandle
from kvcached_service.backends.host import HostBackend
from kvcached_service.config import ConfigError, load_settings, parse_size, resolve_limit


# ---- settings -----------------------------------------------------------------
def test_sizes():
    assert parse_size("2MiB") == 2 << 20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("4096") == 4096
    assert resolve_limit("50%", 1000) == 500
    for bad in ("lots", "-1", "2XB", ""):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(ValueError):
        resolve_limit("150%", 100)


def test_precedence_cli_env_file(tmp_path, monkeypatch):
    cfg = tmp_path / "c.toml"
    cfg.write_text('memory_limit = "1GiB"\npage_size = "4MiB"\nprealloc = "8MiB"\n')
    monkeypatch.setenv("KVCACHED_PAGE_SIZE", "8MiB")
    monkeypatch.setenv("KVCACHED_PREALLOC", "16MiB")
    s = load_settings({"prealloc": "32MiB"}, str(cfg))
    assert s.memory_limit == "1GiB"  # file
    assert s.page_size == "8MiB"  # env over file
    assert s.prealloc == "32MiB"  # flag over env


def test_invalid_settings_name_the_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_SOCKET_MODE", "999")
    with pytest.raises(ConfigError) as info:
        load_settings({"metrics_address": "nowhere"})
    text = str(info.value)
    assert "socket_mode" in text and "KVCACHED_SOCKET_MODE" in text
    assert "metrics_address" in text and "host:port" in text
    with pytest.raises(ConfigError, match="config file not found"):
        load_settings({}, str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("this is = = not toml")
    with pytest.raises(ConfigError):
        load_settings({}, str(bad))
    (tmp_path / "extra.toml").write_text('bogus_setting = 1\n')
    with pytest.raises(ConfigError, match="bogus_setting"):
        load_settings({}, str(tmp_path / "extra.toml"))


def test_uid_lists_from_env(monkeypatch):
    monkeypatch.setenv("KVCACHED_ALLOWED_UIDS", "1000, 1001")
    assert load_settings({}).allowed_uids == [1000, 1001]


# ---- errors -------------------------------------------------------------------
class _FakeRpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._c, self._d = code, details

    def code(self):
        return self._c

    def details(self):
        return self._d


@pytest.mark.parametrize("cls", errors.ALL_ERRORS)
def test_error_round_trip(cls):
    code, msg = errors.to_status(cls("what went wrong"))
    back = errors.from_rpc_error(_FakeRpcError(code, msg))
    assert type(back) is cls and back.message == "what went wrong"
    by_number = errors.from_code(code.value[0], msg)  # as it travels on the fd channel
    assert type(by_number) is cls and by_number.message == "what went wrong"
    assert type(errors.from_code(99, "x")) is errors.Unknown


def test_unexpected_exception_is_internal():
    code, msg = errors.to_status(ZeroDivisionError("x"))
    assert code is grpc.StatusCode.INTERNAL and "ZeroDivisionError" in msg
    assert isinstance(errors.from_rpc_error(_FakeRpcError(grpc.StatusCode.DATA_LOSS, "d")), errors.Unknown)


# ---- fd channel framing -------------------------------------------------------
def test_hello_bytes_match_the_spec():
    rec = fdchannel.encode_hello(fdchannel.Hello(7, 100, 1000, 1001, 253, bytes(range(32))))
    assert rec[:4] == b"KVCF" and rec[4:6] == b"\x01\x00" and rec[6:8] == b"\x01\x00"
    assert int.from_bytes(rec[8:12], "little") == 56 and len(rec) == 16 + 56
    assert int.from_bytes(rec[16:24], "little") == 7
    assert rec[-32:] == bytes(range(32))
    assert fdchannel.decode(rec, []) == fdchannel.Hello(7, 100, 1000, 1001, 253, bytes(range(32)))


def test_pages_round_trip_with_real_fds():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fds = [os.memfd_create("t") for _ in range(3)]
    for i, fd in enumerate(fds):
        os.write(fd, bytes([i]))
    fdchannel.send_record(a, fdchannel.encode_pages(9, 253, 256, [11, 12, 13]), fds)
    rec = fdchannel.recv_record(b)
    assert isinstance(rec, fdchannel.Pages)
    assert (rec.allocation_id, rec.first_index, rec.total, rec.page_ids) == (9, 253, 256, (11, 12, 13))
    for i, fd in enumerate(rec.fds):
        assert os.pread(fd, 1, 0) == bytes([i])
    fdchannel.close_fds(rec.fds + tuple(fds))
    a.close()
    assert fdchannel.recv_record(b) is None


def test_malformed_records_are_rejected():
    good = fdchannel.encode_pages(1, 0, 1, [5])
    with pytest.raises(fdchannel.ProtocolError, match="carries 0 fds"):
        fdchannel.decode(good, [])
    with pytest.raises(fdchannel.ProtocolError, match="bad magic"):
        fdchannel.decode(b"XXXX" + good[4:], [1])
    with pytest.raises(fdchannel.ProtocolError, match="version"):
        fdchannel.decode(good[:4] + b"\x02\x00" + good[6:], [1])
    with pytest.raises(fdchannel.ProtocolError, match="header says"):
        fdchannel.decode(good + b"x", [1])
    with pytest.raises(fdchannel.ProtocolError, match="shorter than the header"):
        fdchannel.decode(b"KV", [])
    with pytest.raises(fdchannel.ProtocolError, match="unknown record type"):
        fdchannel.decode(good[:6] + b"\x7f\x00" + good[8:], [1])
    with pytest.raises(ValueError):
        fdchannel.encode_pages(1, 0, 254, list(range(254)))
    err = fdchannel.decode(fdchannel.encode_error(7, "nope"), [])
    assert err == fdchannel.Error(7, "nope")
    assert fdchannel.decode(fdchannel.encode_goodbye(), []) == fdchannel.Goodbye()


def test_generated_python_is_up_to_date():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---- host backend ---------------------------------------------------------------
def test_host_pages_are_sealed_and_zeroable():
    import mmap

    b = HostBackend(1 << 30)
    (page,) = b.create_pages(0, 1, 1 << 21, zero=True)
    m = mmap.mmap(page.fd, 1 << 21)
    m[:4] = b"data"
    with pytest.raises(OSError):
        os.ftruncate(page.fd, 0)  # sealed: nobody can shrink a page under a mapping
    b.zero_pages(0, [page])
    assert m[:4] == b"\0\0\0\0"  # punching the hole zeroes every mapping
    m.close()
    b.release_pages(0, [page])
    assert page.fd == -1


# ---- pool accounting with a fake backend ---------------------------------------
class FakeBackend(Backend):
    kind = "fake"

    def __init__(self, fail_create_at: int = 0):
        self.live = 0
        self.calls = 0
        self.fail_create_at = fail_create_at

    def devices(self):
        return [DeviceSpec("FAKE-0", "fake", "host", 0, 1 << 40, 4096)]

    def create_pages(self, device, count, page_size, zero):
        self.calls += 1
        if self.calls == self.fail_create_at:
            raise errors.Internal("CUDA_ERROR_UNKNOWN (injected)")
        self.live += count
        return [PageHandle(fd=1000 + i, size=page_size) for i in range(count)]

    def zero_pages(self, device, pages):
        pass

    def release_pages(self, device, pages):
        self.live -= len(pages)

    def adopt_pages(self, device, fds, page_size):
        self.live += len(fds)
        return [PageHandle(fd=fd, size=page_size) for fd in fds]


def _pool(backend, budget_pages=16, warm=0):
    from kvcached_service.server.pool import DevicePool
    from kvcached_service.server.worker import DeviceWorker

    w = DeviceWorker(backend, 0, "fake")
    w.start()
    return DevicePool(backend, backend.devices()[0], w, page_size=4096, budget_bytes=budget_pages * 4096,
                      warm_pages=warm, idle_seconds=0, zero_pages=True)


class _S:
    def __init__(self, sid, uid):
        self.id, self.uid, self.name = sid, uid, f"s{sid}"


def test_pool_books_and_uid_partitioning():
    async def run():
        be = FakeBackend()
        pool = _pool(be)
        a, b = _S(1, 1000), _S(2, 2000)
        pa = await pool.acquire(a, 10)
        pool.check()
        assert (pool.n_in_use, pool.n_free) == (10, 6)
        await pool.give_back(pa)
        pool.check()
        assert pool.n_pooled == 10 and pool.n_ready_for(1000) == 10 and pool.n_ready_for(2000) == 0
        # uid 2000 needs 16: 6 from free budget, 10 by releasing uid 1000's pooled pages
        pb_ = await pool.acquire(b, 16)
        assert not {p.id for p in pa} & {p.id for p in pb_}
        assert pool.counters.released_total == 10 and be.live == 16
        pool.check()
        with pytest.raises(errors.ResourceExhausted, match="cannot allocate 1 pages"):
            await pool.acquire(a, 1)
        await pool.give_back(pb_)
        # same uid gets its own pages back without creating new ones
        created = pool.counters.created_total
        again = await pool.acquire(b, 16)
        assert pool.counters.created_total == created
        assert {p.id for p in again} == {p.id for p in pb_}
        pool.worker.stop()

    asyncio.run(run())


def test_pool_rolls_back_when_create_fails():
    async def run():
        be = FakeBackend(fail_create_at=2)
        pool = _pool(be)
        s = _S(1, 1)
        first = await pool.acquire(s, 4)
        await pool.give_back(first)
        with pytest.raises(errors.Internal, match="injected"):
            await pool.acquire(s, 8)  # 4 ready + 4 to create: the create fails
        pool.check()
        assert pool.n_ready_for(1) == 4 and pool.n_in_use == 0 and pool.n_free == 12
        pool.worker.stop()

    asyncio.run(run())


def test_pool_warm_pages_and_idle_trim():
    async def run():
        be = FakeBackend()
        pool = _pool(be, warm=4)
        await pool.prefill()
        assert pool.n_pooled == 4
        s = _S(1, 1)
        pages = await pool.acquire(s, 8)
        await asyncio.sleep(0.05)  # background refill
        assert pool.n_ready_total() == 4
        await pool.give_back(pages)
        assert pool.n_pooled == 12
        released = await pool.trim_idle()
        assert released == 8 and pool.n_pooled == 4  # back to the warm target
        pool.check()
        pool.worker.stop()

    asyncio.run(run())
