"""What a clean stop (SIGTERM) of the daemon does to pages its clients
still map. Found by the chaos run through a real Ollama (bench/chaos.py,
docs/reliability.md "A chaos run through a real Ollama"): after a SIGTERM,
runners answered with tokens that differ from stock.

The daemon's shutdown ends every session (daemon.py finish_shutdown ->
end_session -> pool.give_back_now), which sends the pages a client wrote to
the zeroer and waits for it before releasing them: a live client's mapped
KV cells read zeros. A SIGKILL leaves them as they are (the resume path).
The fix belongs to the daemon (not zeroing, nor recycling, pages whose
sessions end because the daemon stops); until it lands the test is an
expected failure, strict, so the fix turns it into a failure to remove the
mark."""

from __future__ import annotations

import signal

import pytest


def _write_then_stop(daemon_factory, tmp_path, sig):
    d = daemon_factory("host", state_dir=str(tmp_path / "state"), memory_limit="64MiB")
    with d.client() as c:
        s = c.open_session("clean-stop")
        pages = s.allocate(2)
        pages[0].write(0, b"my kv cells")
        assert pages[0].read(0, 11) == b"my kv cells"
        d.proc.send_signal(sig)
        d.proc.wait(60)
        return pages[0].read(0, 11)


def test_sigkill_leaves_mapped_pages_alone(daemon_factory, tmp_path):
    assert _write_then_stop(daemon_factory, tmp_path, signal.SIGKILL) == b"my kv cells"


@pytest.mark.xfail(strict=True, reason="the daemon zeroes the pages of the sessions a SIGTERM ends, while their "
                                       "clients still map them (daemon.py finish_shutdown; issue 46 item 1's chaos run)")
def test_sigterm_leaves_mapped_pages_alone(daemon_factory, tmp_path):
    assert _write_then_stop(daemon_factory, tmp_path, signal.SIGTERM) == b"my kv cells"
