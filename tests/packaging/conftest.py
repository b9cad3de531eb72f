"""The packaging suite's inputs, made by scripts/test-packaging.sh: the
sdist and wheel (KVC_PKG_DIST), the image built from the Dockerfile
(KVC_PKG_IMAGE) and the podman command with its private store
(KVC_PKG_PODMAN). Run the suite with that script; pytest alone fails with a
message naming it."""

from __future__ import annotations

import os
import pathlib
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _need(var: str) -> str:
    v = os.environ.get(var)
    if not v:
        pytest.fail(f"${var} is not set: run the packaging suite with scripts/test-packaging.sh (it builds what these tests use)")
    return v


@pytest.fixture(scope="session")
def dist() -> pathlib.Path:
    return pathlib.Path(_need("KVC_PKG_DIST"))


def _one(dist: pathlib.Path, pattern: str) -> pathlib.Path:
    found = sorted(dist.glob(pattern))
    assert len(found) == 1, f"want one {pattern} in {dist}, found {found}"
    return found[0]


@pytest.fixture(scope="session")
def wheel(dist) -> pathlib.Path:
    return _one(dist, "*.whl")


@pytest.fixture(scope="session")
def sdist(dist) -> pathlib.Path:
    return _one(dist, "*.tar.gz")


@pytest.fixture(scope="session")
def podman() -> list[str]:
    return shlex.split(_need("KVC_PKG_PODMAN"))


@pytest.fixture(scope="session")
def image() -> str:
    return _need("KVC_PKG_IMAGE")


@pytest.fixture(scope="session")
def work() -> pathlib.Path:
    return pathlib.Path(_need("KVC_PKG_WORK"))
