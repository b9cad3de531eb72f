"""bench/overhead.py (issue 30 item 1) in its quick mode: both llama-servers
serve the same prompt, alternated, and every figure is reported. No timing
assertion: the figures are in docs/benchmarks.md."""

from __future__ import annotations

import json
import subprocess

from kvtest import PY, ROOT


def test_overhead_harness_reports_both_sides(tmp_path):
    r = subprocess.run([PY, "-m", "bench.overhead", "--quick", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (raw,) = tmp_path.glob("overhead-quick-*.json")
    res = json.loads(raw.read_text())
    rows = res["rows"]
    assert [x["side"] for x in rows] == ["unpatched", "patched", "patched", "unpatched"]
    for x in rows:
        assert x["prompt_n"] == res["prompt_tokens"] and x["predicted_n"] == res["predict"]
        assert x["prefill_tps"] > 0 and x["decode_tps"] > 0 and x["ttft_s"] > 0
    patched = [x for x in rows if x["side"] == "patched"]
    unpatched = [x for x in rows if x["side"] == "unpatched"]
    # the patched server's KV cache is in daemon pages: one mapping per page range at least
    assert min(x["maps_after"] for x in patched) > max(x["maps_after"] for x in unpatched)
    s = res["summary"]
    for k in ("prefill_tps", "decode_tps", "ttft_s"):
        assert s["ratio"][k] == s["patched"][k]["median"] / s["unpatched"][k]["median"]
    assert set(s["goals"]) == {"decode", "prefill"}
    md = (raw.with_suffix(".md")).read_text()
    assert "| decode tokens/s |" in md and "| goal (patched / unpatched, medians) |" in md
