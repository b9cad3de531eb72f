"""What a clean stop (SIGTERM) of the daemon does to pages its clients
still map. Found by the chaos run through a real Ollama (bench/chaos.py,
docs/reliability.md "A chaos run through a real Ollama"): after a SIGTERM,
runners answered with tokens that differ from stock.

The daemon's shutdown ends every session (daemon.py finish_shutdown ->
end_session -> pool.give_back_now). It used to send the pages a client had
written to the zeroer and wait for it before releasing them, so a live
client's mapped KV cells read zeros. Now pages whose sessions end because
the daemon stops are released without zeroing: nobody gets them from this
daemon again, and their client may still map them (and resume them from a
restarted daemon, whose books then hold them). A SIGKILL leaves them as
they are too (the resume path). Pages given back before the stop are
zeroed as always (the isolation tests).
"""

from __future__ import annotations

import signal

import pytest


def _write_then_stop(daemon_factory, tmp_path, backend, sig, state: bool):
    extra = {"state_dir": str(tmp_path / "state")} if state else {}
    d = daemon_factory(backend, memory_limit="64MiB", **extra)
    with d.client() as c:
        s = c.open_session("clean-stop")
        pages = s.allocate(2)
        pages[0].write(0, b"my kv cells")
        assert pages[0].read(0, 11) == b"my kv cells"
        d.proc.send_signal(sig)
        assert d.proc.wait(60) in (0, -signal.SIGKILL), d.log_text()
        return pages[0].read(0, 11)


@pytest.mark.parametrize("state", [True, False], ids=["state-dir", "no-state-dir"])
def test_sigkill_leaves_mapped_pages_alone(daemon_factory, tmp_path, backend, state):
    assert _write_then_stop(daemon_factory, tmp_path, backend, signal.SIGKILL, state) == b"my kv cells"


@pytest.mark.parametrize("state", [True, False], ids=["state-dir", "no-state-dir"])
def test_sigterm_leaves_mapped_pages_alone(daemon_factory, tmp_path, backend, state):
    assert _write_then_stop(daemon_factory, tmp_path, backend, signal.SIGTERM, state) == b"my kv cells"
