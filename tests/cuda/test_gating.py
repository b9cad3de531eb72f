"""The gate of the tests that need the test driver's private features
(kvtest.require_testdriver_features, Sim.need_knobs): they skip only on
another libcuda (KVCACHED_TEST_LIBCUDA naming a library that is not the
test driver); on the test driver itself a missing feature fails them, so a
test driver that lost its knobs cannot turn its tests into skips."""

from __future__ import annotations

import pathlib

import pytest

import kvtest
from tdkit import Sim


def _features(monkeypatch, present: bool, lib: str | None) -> None:
    monkeypatch.setattr(kvtest, "_features", present)
    if lib is None:
        monkeypatch.delenv("KVCACHED_TEST_LIBCUDA", raising=False)
    else:
        monkeypatch.setenv("KVCACHED_TEST_LIBCUDA", lib)


def test_missing_features_fail_on_the_default_test_driver(monkeypatch):
    _features(monkeypatch, False, None)
    with pytest.raises(pytest.fail.Exception, match="lacks its private features"):
        kvtest.require_testdriver_features("KVCACHED_TESTDRV_FAIL")


def test_missing_features_fail_when_the_variable_names_the_test_driver(monkeypatch):
    _features(monkeypatch, False, str(kvtest.TESTDRIVER))
    with pytest.raises(pytest.fail.Exception, match="lacks its private features"):
        kvtest.require_testdriver_features("KVCACHED_TESTDRV_FAIL")


def test_missing_features_skip_on_another_libcuda(monkeypatch, tmp_path):
    _features(monkeypatch, False, str(tmp_path / "libcuda.so.1"))
    with pytest.raises(pytest.skip.Exception, match="KVCACHED_TESTDRV_FAIL"):
        kvtest.require_testdriver_features("KVCACHED_TESTDRV_FAIL")


def test_present_features_neither_skip_nor_fail(monkeypatch):
    _features(monkeypatch, True, None)
    kvtest.require_testdriver_features("KVCACHED_TESTDRV_FAIL")


def test_a_knob_fails_on_the_test_driver_and_skips_elsewhere(monkeypatch, tmp_path):
    sim = Sim(kvtest.TESTDRIVER, tmp_path / "state", tmp_path, private=False)
    _features(monkeypatch, False, None)
    with pytest.raises(pytest.fail.Exception):
        sim.need_knobs({"KVCACHED_TESTDRV_MEMORY": "1M"})
    _features(monkeypatch, False, str(pathlib.Path(tmp_path) / "other" / "libcuda.so.1"))
    with pytest.raises(pytest.skip.Exception, match="KVCACHED_TESTDRV_MEMORY"):
        sim.need_knobs({"KVCACHED_TESTDRV_MEMORY": "1M"})
    sim.need_knobs({"CUDA_VISIBLE_DEVICES": "0"})  # not a knob: nothing to need
