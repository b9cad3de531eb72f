"""bench/chaos.py's schedule and oracle, without Ollama (the run itself is
in scripts/test-ollama.sh, quick mode): the seeded schedule replays, a quick
run sees every fault kind, and the verdict counts what it must."""

from __future__ import annotations

import argparse
import pathlib

from bench import chaos


def args(**kw) -> argparse.Namespace:
    a = dict(seed=46, quick=True, duration=100.0, gap=9.0, kinds=None, clients=8, parallel=1, first_fault=5, tail=5,
             audit_every=2, check_every=300.0)
    a.update(kw)
    return argparse.Namespace(**a)


def test_schedule_is_seeded_and_quick_sees_every_kind(tmp_path):
    one = chaos.Chaos(args(), tmp_path).schedule(100)
    assert one == chaos.Chaos(args(), tmp_path).schedule(100)
    assert one != chaos.Chaos(args(seed=47), tmp_path).schedule(100)
    assert set(chaos.ALL_KINDS) <= {k for _, k in one}
    times = [t for t, _ in one]
    assert times == sorted(times) and times[0] == 5 and times[-1] < 95
    ci = "daemon_kill,budget,runner_kill,unload,squeeze"
    kinds = {k for _, k in chaos.Chaos(args(kinds=ci), tmp_path).schedule(100)}
    assert kinds == set(ci.split(","))


def run_with(tmp_path, records, faults, checks=(), samples=(), **kw):
    ch = chaos.Chaos(args(**kw), tmp_path)
    ch.records, ch.faults, ch.checks, ch.samples = list(records), list(faults), list(checks), list(samples)
    return ch.result()


def req(t, end, ok=True, same=True, model="chaos4l", runner=100, **kw):
    return dict(client=0, model=model, prompt=0, t=t, end=end, ok=ok, same=same, latency=end - t, runner=runner, **kw)


def test_verdict(tmp_path):
    audit = dict(audit=True, books_ok=True, pages_ok=True, leaked_pages=0, outside_pages=0)
    fine = run_with(tmp_path, [req(0, 1), req(1, 2)], [], [audit])
    assert fine["goal"]["met"] and fine["requests"]["total"] == 2
    # a failure while its model's runner was SIGKILLed is explained; another one is not
    kill = dict(t=5.0, kind="runner_kill", model="chaos4l", pid=100)
    r = run_with(tmp_path, [req(4, 6, ok=False, error="x"), req(7, 8, ok=False, error="y", model="chaos2l")], [kill], [audit])
    assert r["requests"]["failed_explained"] == 1 and r["requests"]["failed_unexplained"] == 1 and not r["goal"]["met"]
    # a differing answer is never explained away; one of a runner alive at a SIGTERM is counted apart
    ch = chaos.Chaos(args(), tmp_path)
    ch.records = [req(10, 12, same=False, runner=100), req(10, 12, same=False, runner=200)]
    ch.checks = [audit]
    ch.zeroed_runners = {100: 3.0}
    r = ch.result()
    assert r["requests"]["differing"] == 2 and r["requests"]["differing_after_sigterm"] == 1 and not r["goal"]["met"]
    # books or pages wrong at a check, or a check that never settled
    for bad in (dict(books_ok=False), dict(pages_ok=False), dict(unsettled=True)):
        assert not run_with(tmp_path, [req(0, 1)], [], [{**audit, **bad}])["goal"]["met"], bad
    # pages are judged at audits only (under load they move)
    assert run_with(tmp_path, [req(0, 1)], [], [{**audit, "audit": False, "pages_ok": None}])["goal"]["met"]


def test_memory_that_grows_is_caught(tmp_path):
    MiB = chaos.MiB

    def sample(t, daemon):
        return dict(t=t, kind="check", daemon={"VmRSS": daemon}, keeper=[], ollama={"VmRSS": 30 * MiB}, runners={})

    flat = [sample(t, 60 * MiB + (t % 2) * MiB) for t in range(0, 1800, 60)]
    grows = [sample(t, 60 * MiB + t * 20_000) for t in range(0, 1800, 60)]  # +36 MiB over the run
    assert not run_with(tmp_path, [req(0, 1)], [], [], flat, duration=1800)["memory"]["daemon"]["grows"]
    assert not run_with(tmp_path, [req(0, 1)], [], [], grows)["memory"]["daemon"]["grows"]  # quick: not judged
    r = run_with(tmp_path, [req(0, 1)], [], [], grows, duration=1800)
    assert r["memory"]["daemon"]["grows"] and r["goal"]["memory_grows"] == ["daemon"] and not r["goal"]["met"]


def test_summary_prints_the_verdict(tmp_path):
    r = run_with(tmp_path, [req(0, 1)], [], [dict(audit=True, books_ok=True, pages_ok=True)])
    text = chaos.summary(r)
    assert "goal" in text and "met" in text and "seed" in text and "--seed 46" in r["replay"]


def test_memfd_inodes_of_this_process():
    import os

    fd = os.memfd_create("kvcached-page")
    try:
        os.ftruncate(fd, 4096)
        assert os.fstat(fd).st_ino in chaos.memfd_inodes(os.getpid())
    finally:
        os.close(fd)
    assert pathlib.Path("/proc/self").exists()
