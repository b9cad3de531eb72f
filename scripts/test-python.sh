#!/usr/bin/env bash
# The Python test suite (daemon, Python client, CUDA backend on the test driver,
# operations, benchmarks in quick mode).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
# The python3.12 of the 3.12 run below, looked for first: without one the
# suite stops now, not after the half hour the first run takes.
py312="$(scripts/preflight.sh --python312)" || {
  scripts/preflight.sh python || true   # says what is missing and how to get it
  echo "test-python: no python3.12 found (set PYTHON312): the 3.12 run cannot be skipped" >&2
  exit 1
}
.venv/bin/python -c 'import pytest, hypothesis, pytest_timeout' 2>/dev/null || {
  echo "test-python: .venv has no test tools (pytest, hypothesis, pytest-timeout): scripts/setup.sh --dev installs them (make test-python runs it)" >&2
  exit 1
}
# The public-only test driver, before the first run: the public-only run
# below and tests/test_drivercalls.py use it.
pub="$(scripts/build-testdriver.sh --public-only | tail -1)"
set +e
# tests/llama needs llama-server builds: scripts/test-llama.sh runs it;
# tests/packaging needs the sdist, wheel and image: scripts/test-packaging.sh;
# tests/ollama needs the Ollama builds: scripts/test-ollama.sh.
.venv/bin/python -m pytest --durations=12 tests --ignore=tests/llama --ignore=tests/packaging --ignore=tests/ollama "$@"
rc=$?
if [ $rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi

# The CUDA test set again on a libcuda with only the public API (the test
# driver built without its private features; docs/cuda.md, "The public-only
# run"; docs/gpu-check.md, "The CUDA test set"): every test marked cuda in the
# files tests/cuda/suite.txt names. At least 110 must pass, none fail, and
# every skip name its reason; the skip list, by reason, goes to
# build/public-only-skips.txt (outcomes test by test: build/public-only-outcomes.txt).
rm -f build/public-only.xml
# shellcheck disable=SC2046
KVCACHED_TEST_LIBCUDA="$pub" .venv/bin/python -m pytest -v -rs -p no:cacheprovider --junitxml=build/public-only.xml \
    -m cuda $(grep -v '^#' tests/cuda/suite.txt) >build/public-only.log 2>&1
.venv/bin/python tests/helpers/pytest_report.py build/public-only.xml --skips build/public-only-skips.txt \
  --outcomes build/public-only-outcomes.txt --min-passed 110 --label "public-only libcuda (log: build/public-only.log)"
rcpub=$?

# The daemon's request path again on Python 3.12 (what GPU hosts run): a real
# python3.12 found a 3.12-only bug there (eager_start, server/transports/channel.py). build/py312 holds
# the package and the test tools; remade when pyproject.toml changes.
if [ ! -f build/py312/.installed ] || [ pyproject.toml -nt build/py312/.installed ]; then
  echo "test-python: making build/py312 with $("$py312" --version)"
  rm -rf build/py312 && "$py312" -m venv build/py312 &&
    build/py312/bin/pip install -q -e . 'pytest>=8' 'pytest-timeout>=2.3' 'hypothesis>=6.100' &&
    touch build/py312/.installed || exit 1
fi
build/py312/bin/python -m pytest -q -p no:cacheprovider tests/test_request_path.py tests/test_elastic.py tests/test_fdchannel.py
rc312=$?
set -e
[ $rc -ne 0 ] && exit $rc
[ $rcpub -ne 0 ] && exit $rcpub
exit $rc312
