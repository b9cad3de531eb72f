"""The GPU model's arithmetic (bench/costmodel.py) on a made-up cost table,
and the real table's shape (every entry sourced, ranges ordered)."""

from __future__ import annotations

import math
import sys

import pytest

from kvtest import ROOT

sys.path.insert(0, str(ROOT))
from bench import costmodel  # noqa: E402

MiB = 1 << 20
TABLE = {
    "page_size": 2 * MiB,
    "run_cost": ["cuMemSetAccess", "cuMemUnmap"],
    "run_cost_default": "page",
    "costs": {
        "cuMemCreate": {"low": 10, "high": 20, "per": "page", "kind": "measured"},
        "cuMemSetAccess": {"low": 30, "high": 30, "per": "page", "kind": "measured"},
        "cuMemExportToShareableHandle": {"low": 40, "high": 40, "per": "call", "kind": "measured"},
    },
    "other": {"low": 0, "high": 2, "per": "call", "kind": "assumed"},
}


def c(calls=None, nbytes=None):
    return {"calls": calls or {}, "bytes": nbytes or {}}


def test_cost_per_page_per_call_and_other():
    # 2 creates of 2 pages each (8 MiB): per page -> 4 x 15 (mid)
    got = costmodel.cost_us(c({"cuMemCreate": 2}, {"cuMemCreate": 8 * MiB}), TABLE)
    assert (got["low"], got["mid"], got["high"]) == (40, 60, 80)
    # export is per call whatever the bytes; an unknown function costs "other"
    got = costmodel.cost_us(c({"cuMemExportToShareableHandle": 3, "cuCtxGetCurrent": 10}), TABLE)
    assert (got["low"], got["mid"], got["high"]) == (120, 130, 140)
    assert got["by_function"]["cuCtxGetCurrent"] == {"n": 10, "per": "call", "us_each": 1.0, "us": 10.0, "kind": "assumed"}


def test_run_cost_page_or_call_for_a_set_access_over_a_run():
    # one cuMemSetAccess over 32 pages
    run = c({"cuMemSetAccess": 1}, {"cuMemSetAccess": 32 * 2 * MiB})
    assert costmodel.cost_us(run, TABLE)["mid"] == 32 * 30
    assert costmodel.cost_us(run, TABLE, run_cost="call")["mid"] == 30
    # cuMemCreate is not a run-cost call: per page either way
    create = c({"cuMemCreate": 1}, {"cuMemCreate": 4 * MiB})
    assert costmodel.cost_us(create, TABLE, run_cost="call")["mid"] == 2 * 15
    with pytest.raises(ValueError):
        costmodel.cost_us(run, TABLE, run_cost="granule")


def test_latency_queue_and_floor():
    client = c({"cuMemExportToShareableHandle": 1})  # 40
    daemon = c({"cuMemCreate": 1}, {"cuMemCreate": 2 * MiB})  # 10/15/20
    got = costmodel.latency(100, client, daemon, TABLE, queue=16)
    assert (got["low"], got["mid"], got["high"]) == (100 + 40 + 160, 100 + 40 + 240, 100 + 40 + 320)
    assert got["inputs"]["queue"] == 16 and got["inputs"]["client_us"] == 40 and got["inputs"]["daemon_us"] == 15
    # the daemon's whole work per op bounds the latency from below (one queue)
    big = c({"cuMemExportToShareableHandle": 10})  # 400
    got = costmodel.latency(100, client, c(), TABLE, floor=big)
    assert got["mid"] == 400 and got["inputs"]["floor_us"] == 400
    got = costmodel.latency(1000, client, c(), TABLE, floor=big)
    assert got["mid"] == 1040


def test_clients_serialised_on_the_device_or_in_parallel():
    client = c({"cuMemExportToShareableHandle": 1})  # 40
    assert costmodel.latency(100, client, c(), TABLE, client_queue=16)["mid"] == 100 + 16 * 40
    par = costmodel.rate(10000, 64, client, c(), TABLE, serial="worker")["mid"]
    dev = costmodel.rate(10000, 64, client, c(), TABLE, serial="device")["mid"]
    assert math.isclose(par, 64 / (6400 + 40) * 1e6) and math.isclose(dev, 64 / (6400 + 64 * 40) * 1e6)


def test_rate_of_n_clients_is_n_over_the_latency():
    # host: 10,000 pairs/s with 64 clients -> 6,400 us per pair; + client 40 + 64 x 15 (mid)
    got = costmodel.rate(10000, 64, c({"cuMemExportToShareableHandle": 1}), c({"cuMemCreate": 1}, {"cuMemCreate": 2 * MiB}), TABLE)
    assert math.isclose(got["mid"], 64 / (6400 + 40 + 64 * 15) * 1e6)
    assert got["low"] < got["mid"] < got["high"]
    # no driver calls: the host's rate
    assert math.isclose(costmodel.rate(10000, 64, c(), c(), TABLE)["mid"], 10000)


def test_predict_rows_from_counted_calls():
    page = 2 * MiB
    per_op = lambda d, cl: {"ops": 1, "daemon_per_op": d, "client_per_op": cl}  # noqa: E731
    cuda = {"roundtrip": {
        "rtt_1_daemon": {"p50_us": 1, "p99_us": 2, "driver_calls": per_op(c({"cuMemExportToShareableHandle": 1}), c())},
        "rtt_16_daemon": {"p50_us": 1, "p99_us": 2, "driver_calls": per_op(c({"cuMemExportToShareableHandle": 1}), c())},
        "tput_64_daemon": {"pairs_per_s": 5, "driver_calls": per_op(c({"cuMemExportToShareableHandle": 1}), c())},
    }, "reclaim": {"moved_bytes": 1 << 30, "reps": 1,
                   "daemon_reclaim": {"p50_us": 9, "driver_calls": per_op(c({"cuMemSetAccess": 1}, {"cuMemSetAccess": 8 * page}),
                                                                          c({"cuMemCreate": 1}, {"cuMemCreate": page}))},
                   "baseline_unload_reload": {"p50_us": 9}}}
    host = {"roundtrip": {"rtt_1_daemon": {"p50_us": 100, "p99_us": 200}, "rtt_16_daemon": {"p50_us": 1000, "p99_us": 2000},
                          "tput_64_daemon": {"pairs_per_s": 10000}},
            "reclaim": {"daemon_reclaim": {"p50_us": 20000}, "baseline_unload_reload": {"p50_us": 10000}}}
    cuda["roundtrip"]["rtt_16_base"] = {"p50_us": 1, "p99_us": 2, "driver_calls": per_op(c(), c({"cuMemExportToShareableHandle": 1}))}
    host["roundtrip"]["rtt_16_base"] = {"p50_us": 30, "p99_us": 60}
    table = {**TABLE, "reference": {"tree": "x", "figures": {"2 Allocate+Free 1 page|1 client p50": [280.0]}}}
    rows = {r["figure"]: r for r in costmodel.predict(cuda, host, table)}
    assert rows["1 client p50"]["predicted"] == 140 and rows["1 client p50"]["host"] == 100
    assert rows["1 client p50"]["error_vs_reference"] == [140 / 280 - 1]
    assert rows["16 clients p50"]["predicted"] == 1000 + 16 * 40  # the daemon's work, once per client ahead in its queue
    assert rows["16 clients p50"]["serial"] == "device" and rows["16 clients p50"]["predicted_serial_worker"] == 1000 + 16 * 40
    assert math.isclose(rows["64 clients pairs/s"]["predicted"], 64 / (6400 + 64 * 40) * 1e6)
    # 16 processes' own calls: serialised on the device (the default), or in parallel
    base = rows["in-process create+map+unmap+release, 16 clients p50"]
    assert base["predicted"] == 30 + 16 * 40 and base["predicted_serial_worker"] == 30 + 40
    with pytest.raises(ValueError):
        costmodel.predict(cuda, host, table, serial="gpu")
    rec = rows["move 1.00 GiB idle->new (median of 1)"]
    # one chain: host 20 ms + 8 pages of set-access (per page) + one create, in ms
    assert math.isclose(rec["predicted"], (20000 + 8 * 30 + 15) / 1e3)
    assert math.isclose(rec["predicted_run_cost_call"], (20000 + 30 + 15) / 1e3)
    assert rec["unit"] == "ms" and rec["testdriver"] == 9 / 1e3


def test_the_cost_table_is_sourced_and_ordered():
    t = costmodel.load()
    assert t["page_size"] == 2 * MiB and t["run_cost_default"] in ("page", "call")
    for fn, e in {**t["costs"], "other": t["other"]}.items():
        assert 0 <= e["low"] <= e["high"], fn
        assert e["per"] in ("page", "call") and e["kind"] in ("measured", "derived", "assumed"), fn
        assert e["source"], fn
    # run 3's measured figures (p50 per 2 MiB page)
    assert t["costs"]["cuMemSetAccess"]["low"] == 25.4 and t["costs"]["cuMemExportToShareableHandle"]["low"] == 36.4
    assert t["costs"]["cuMemImportFromShareableHandle"]["kind"] == "derived"
