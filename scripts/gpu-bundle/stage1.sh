#!/usr/bin/env bash
# Stage 1 of the offline GPU bundle: scripts/gpu-check.sh, all four of its
# stages (driver probe, the daemon end to end with two client processes, the
# CUDA behaviour tests, the CUDA bench) on $KVCACHED_LIBCUDA, device 0, its
# rows, figures and logs written into $STAGE_OUT (GPU_CHECK_OUT).
#
# On the CUDA test driver (VERIFY_DRIVER=testdriver: the dry run of make
# test) gpu-check.sh would skip its stages 3 and 4 (make test runs those
# suites on it); here they run on a part that fits the dry run's few minutes:
# GPU_CHECK_TESTS and GPU_CHECK_BENCH below (set them to override). On a real
# driver gpu-check.sh's own defaults apply (the whole CUDA test set, the
# last GPU run's failures first, tests/cuda/gpu-first.txt; the bench's
# allocate64 and roundtrip). Whatever runs, $STAGE_OUT receives the whole
# record: rows.jsonl, table.md, verdict.txt, figures.json, the logs, and of
# the tests pytest.log (-v: every test in the order it ran), pytest.xml,
# skips.txt (every skip with its reason), outcomes.txt, pytest-report.txt.
set -u
: "${REPO:?}" "${PYTHON:?}" "${STAGE_OUT:?}" "${KVCACHED_LIBCUDA:?}"
cd "$REPO"
export PYTHON KVCACHED_LIBCUDA GPU_CHECK_OUT="$STAGE_OUT"
if [[ "${VERIFY_DRIVER:-real}" == testdriver ]]; then
    STATE="$(mktemp -d "${TMPDIR:-/tmp}/kvcached-bundle-gpu.XXXXXX")"
    trap 'rm -rf "$STATE"' EXIT
    export KVCACHED_TESTDRV_STATE="$STATE" KVCACHED_TESTDRV_MEMORY="${KVCACHED_TESTDRV_MEMORY:-1G}"
    # seconds: the path, not the coverage (make test runs them all); test_mapping_rules is one of the
    # last GPU run's failures (tests/cuda/gpu-first.txt): it runs first, and its row says so
    export GPU_CHECK_TESTS="${GPU_CHECK_TESTS-tests/cuda/test_cuda_mapper.py tests/cuda/test_public_api.py::test_mapping_rules}"
    export GPU_CHECK_BENCH="${GPU_CHECK_BENCH-allocate64}"
fi
scripts/gpu-check.sh
