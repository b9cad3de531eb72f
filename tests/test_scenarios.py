"""The client semantics (docs/protocol.md, "Client semantics"), as scenarios
the Python client plays against a scriptable fake daemon end.

Each tests/scenarios/*.json holds the daemon's side (`daemon.script`, played
by tests/helpers/fakedaemon.py in a subprocess) and the client's side
(`client`: the operations and what each must return or raise). The Go and C
tests can run the same files against the same fake: only the `client` ops
below need an implementation per client. Client ops:

  open_session name [expect]      connect (timeout: the scenario's client_timeout, default 5 s) and open
  allocate num_pages [expect]     expect: {page_ids, contents} or {error, message_contains}
                                  contents: each page's descriptor holds "kvc-fake page <id>"
  free page_ids [expect]          expect: {value} (pages freed) or {error}
  wait_resuming                   until the client noticed the channel hung up (it resumes)
  wait_resumed                    until the session is usable again
  wait_ended                      until the client saw the channel end (ERROR, GOODBYE)
  signal name                     tell the fake ("signal NAME" on its stdin)
  sleep seconds
  close                           close the session and the client
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from kvtest import HELPERS, PY, ROOT, wait_until
from kvcached_service import errors
from kvcached_service.client import Client

SCENARIOS = sorted((ROOT / "tests" / "scenarios").glob("*.json"))


def marker(page_id: int) -> bytes:
    return f"kvc-fake page {page_id}".encode()


class Harness:
    def __init__(self, scenario: dict, fake: subprocess.Popen, sock: str):
        self.sc = scenario
        self.fake = fake
        self.sock = sock
        self.client: Client | None = None
        self.session = None
        self.fds: list[int] = []

    def expect(self, op: dict, fn):
        want = op.get("expect", {})
        if "error" in want:
            with pytest.raises(errors.KVCachedError) as info:
                fn()
            err = info.value
            assert err.code.name == want["error"], f"{op}: raised {err.code.name}: {err.message}"
            assert want.get("message_contains", "") in err.message, f"{op}: {err.message!r}"
            return None
        return fn()

    def run(self, op: dict) -> None:
        kind = op["op"]
        if kind == "open_session":
            self.client = Client.connect(self.sock, timeout=self.sc.get("client_timeout", 5.0))
            s = self.expect(op, lambda: self.client.open_session(op["name"]))
            if s is not None:
                self.session = s
        elif kind == "allocate":
            got = self.expect(op, lambda: self.session.allocate_fds(op["num_pages"]))
            if got is not None:
                a, fds = got
                self.fds.extend(fds)
                want = op.get("expect", {})
                if "page_ids" in want:
                    assert list(a.page_ids) == want["page_ids"], op
                if want.get("contents"):
                    for pid, fd in zip(a.page_ids, fds):
                        assert os.pread(fd, len(marker(pid)), 0) == marker(pid), f"the descriptor of page {pid} is another page"
        elif kind == "free":
            n = self.expect(op, lambda: self.session.free_ids(op["page_ids"]))
            if n is not None and "value" in op.get("expect", {}):
                assert n == op["expect"]["value"], op
        elif kind == "wait_resuming":
            assert wait_until(lambda: self.session.resuming, timeout=10), "the client did not notice the hang-up"
        elif kind == "wait_resumed":
            assert self.session.wait_resumed(20), f"not resumed: {self.session._state} {self.session._dead}"
        elif kind == "wait_ended":
            assert wait_until(lambda: self.session._channel.ended is not None, timeout=10), "the client did not see the end"
        elif kind == "signal":
            self.fake.stdin.write(f"signal {op['name']}\n")
            self.fake.stdin.flush()
        elif kind == "sleep":
            import time

            time.sleep(op["seconds"])
        elif kind == "close":
            if self.session is not None:
                self.session.close()
            if self.client is not None:
                self.client.close()
        else:
            raise AssertionError(f"unknown client op {kind!r}")

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        if self.session is not None:
            self.session.close()
        if self.client is not None:
            self.client.close()


def test_every_scenario_names_a_documented_semantics():
    doc = (ROOT / "docs" / "protocol.md").read_text()
    section = doc[doc.index("## Client semantics"):]
    assert len(SCENARIOS) >= 10
    for path in SCENARIOS:
        sc = json.loads(path.read_text())
        assert sc["name"] == path.stem
        assert f"`{path.stem}`" in section, f"docs/protocol.md's client semantics do not cite scenario {path.stem}"
        assert sc["semantics"] and sc["about"] and sc["client"] and sc["daemon"]["script"]


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_scenario(path, tmp_path):
    sc = json.loads(path.read_text())
    sock = str(tmp_path / "fake.sock")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    fake = subprocess.Popen([PY, str(HELPERS / "fakedaemon.py"), "--socket", sock, "--scenario", str(path)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    h = Harness(sc, fake, sock)
    try:
        line = fake.stdout.readline()
        assert line and json.loads(line)["ready"], fake.stderr.read()
        for op in sc["client"]:
            h.run(op)
    finally:
        h.close()
    out, err = fake.communicate(timeout=60)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["ok"], f"the fake daemon's script failed: {result}\n{err[-3000:]}"
    assert fake.returncode == 0
