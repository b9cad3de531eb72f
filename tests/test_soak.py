"""The soak (bench/soak.py, issue 46 item 3) in quick mode on the host backend:
50,000 one-page Allocate/Free cycles from 64 compiled clients and 2,000
sessions opened and closed, the daemon sampled every 2 s. Asserts the verdict
(nothing grows after warm-up, by the rule in bench/soak.py and
docs/reliability.md), the generous idle bounds of quick mode, and the files."""

from __future__ import annotations

import json
import subprocess

from kvtest import PY, ROOT


def test_quick_soak_host_nothing_grows(tmp_path):
    proc = subprocess.run([PY, "-m", "bench.soak", "--quick", "--backend", "host", "--out-dir", str(tmp_path), "--img-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"bench.soak exited {proc.returncode}\nstdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-4000:]}"
    out = tmp_path / "soak-host-quick.json"
    img = tmp_path / "soak-host-quick.png"
    assert out.exists() and img.exists() and img.stat().st_size > 10_000, proc.stdout
    r = json.loads(out.read_text())
    assert not r["failed"] and r["daemon_exit"] == 0, r["failed"]
    assert r["cycles_done"] >= 50_000 and r["sessions_done"] >= 2_000, (r["cycles_done"], r["sessions_done"])
    assert r["progress"]["py_sessions"] > 0 and r["progress"]["loadc_sessions"] > 0, r["progress"]
    assert len(r["samples"]) >= 5, len(r["samples"])
    an = r["analysis"]
    assert an["verdict"] == "flat", (an["verdicts"], an["fits"])
    for res in ("rss_mib", "fds", "threads", "tasks", "series"):
        assert an["verdicts"][res] in ("flat", "falls"), (res, an["fits"][res])
        assert an["fits"][res]["n"] >= 3, (res, an["fits"][res])
    # the probe saw the daemon's own structures and its loop
    s = r["samples"][-1]
    assert "Daemon.sessions" in s["structures"] and s["tasks"] > 0 and s["series"] > 0, s
    # idle end minus idle start, where the load's noise is absent: nothing left behind but pooled pages
    idle = an["idle_delta"]
    assert idle["fds_less_pages"] <= 16 and idle["threads"] <= 4 and idle["tasks"] <= 16 and idle["series"] <= 16, idle
    assert idle["rss_mib"] <= 64, idle
    assert "[soak host]" in proc.stdout and "verdict: flat" in proc.stdout
