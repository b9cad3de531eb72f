#!/usr/bin/env bash
# The offline GPU bundle's dry run (issue 24 item 3; docs/gpu-check.md "The
# offline GPU bundle"): builds the bundle (scripts/gpu-bundle.sh, each part
# cached by its input hash under build/gpu-bundle/cache), which fails over
# 56 MiB, then runs its verify.sh here against the CUDA test driver, the way a
# GPU host runs it:
#   - python3.12 (what GPU hosts run; found as scripts/test-python.sh finds it)
#     with the bundle's cp312 wheels; what such a host has of its own
#     (grpcio, protobuf, prometheus-client, nvidia-ml-py, numpy, pytest) comes
#     from build/gpu-bundle/host-py312, installed once from PyPI at this
#     machine's .venv versions (torch is left out: nothing the stages run here
#     needs it);
#   - VERIFY_DRIVER=testdriver, KVCACHED_LIBCUDA=build/testdriver/libcuda.so.1.
# Passes when the stage 1 (gpu-check) and stage 2 (Go and C clients) rows
# all pass, stage 3's (llama.cpp on a GPU) are skipped with "no CUDA runtime",
# stage 4's have no FAIL, stage 5 (capacity) passes its scaled CPU scenario
# on build/llama's CPU builds (skip rows without them), and verify.sh ends
# in PASS. The bundle and results
# stay in build/gpu-bundle/dry-run.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
export JOBS="${JOBS:-2}"

[[ -f build/testdriver/libcuda.so.1 ]] || scripts/build-testdriver.sh

py312=""
for c in "${PYTHON312:-}" python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
  [ -n "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { py312=$c; break; }
done
[[ -n "$py312" ]] || { echo "test-gpu-bundle: no python3.12 found (set PYTHON312): the dry run needs it" >&2; exit 1; }

DRY="$ROOT/build/gpu-bundle/dry-run"
mkdir -p "$DRY"
t0=$(date +%s)
echo "== scripts/gpu-bundle.sh $DRY/bundle"
scripts/gpu-bundle.sh "$DRY/bundle"
t1=$(date +%s)

# A GPU host's own site-packages, for python3.12 (cached by the pins).
HOST_PINS="$(.venv/bin/python -c '
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in ("grpcio", "protobuf", "prometheus-client", "nvidia-ml-py", "numpy", "pytest")))')"
HOST_SITE="$ROOT/build/gpu-bundle/host-py312"
if [[ "$(cat "$HOST_SITE/.pins" 2>/dev/null)" != "$HOST_PINS" ]]; then
  echo "== a GPU host's packages for $("$py312" --version) into $HOST_SITE: $HOST_PINS"
  rm -rf "$HOST_SITE"
  # shellcheck disable=SC2086
  "$py312" -m pip install -q --disable-pip-version-check --target "$HOST_SITE" --only-binary :all: $HOST_PINS
  echo "$HOST_PINS" >"$HOST_SITE/.pins"
fi

# Stage 5 (capacity, issue 44) runs its scenario scaled for the CPU on the
# llama suite's builds when they are there (make test builds them first):
# 1 slot, an emulated device of 176 MiB: 3 stock runners, 10 patched ones, about
# 10 s here.
STAGE5_ENV=()
if [[ -x build/llama/build-orig/bin/llama-server && -x build/llama/build-kvc/bin/llama-server ]]; then
  STAGE5_ENV=(STAGE5_DEVICE=cpu "STAGE5_BUILD=prebuilt:$ROOT/build/llama" STAGE5_PARALLEL=1
              STAGE5_CPU_DEVICE_MIB="${STAGE5_CPU_DEVICE_MIB:-176}" STAGE5_MAX_MODELS=12)
fi

echo "== verify.sh on the CUDA test driver (python $("$py312" --version 2>&1))"
rm -rf "$DRY/out" "$DRY/work"
set +e
env "${STAGE5_ENV[@]}" PYTHON="$py312" VERIFY_EXTRA_SITE="$HOST_SITE" VERIFY_DRIVER=testdriver \
  KVCACHED_LIBCUDA="$ROOT/build/testdriver/libcuda.so.1" VERIFY_OUT="$DRY/out" VERIFY_WORK="$DRY/work" \
  "$DRY/bundle/verify.sh" 2>&1 | tee "$DRY/verify.out"
set -e
t2=$(date +%s)
rm -rf "$DRY/work"

STAGE5_CPU="${#STAGE5_ENV[@]}" .venv/bin/python - "$DRY/out/results.json" "$DRY/verify.out" "$DRY/out/stage1/verdict.txt" <<'EOF'
import json, os, sys
res = json.load(open(sys.argv[1]))
last = open(sys.argv[2]).read().rstrip().splitlines()[-1]
rows = res["rows"]
bad = []
by = lambda n: [r for r in rows if r.get("stage") == n]
# gpu-check's own verdict (stage 1) is PASS only when no stage it was asked
# to run was skipped; its skip rows are then checks this machine cannot make
# (a second device for peer access).
gpu_check = open(sys.argv[3]).read().strip() if os.path.exists(sys.argv[3]) else "(no verdict.txt)"
if gpu_check != "PASS":
    bad.append(f"stage 1: gpu-check.sh's verdict: {gpu_check}")
for n in (0, 1, 2):
    if not by(n):
        bad.append(f"stage {n}: no rows")
    for r in by(n):
        if r["verdict"] not in ("pass", "info") and not (n == 1 and r["verdict"] == "skip"):
            bad.append(f"stage {n}: {r['check']}: {r['verdict']}: {r['seen']}")
if len([r for r in by(1) if r["verdict"] == "pass"]) < 40:
    bad.append(f"stage 1: only {len([r for r in by(1) if r['verdict'] == 'pass'])} pass rows (gpu-check has 40+)")
progs = [r for r in by(2) if r["check"] in ("Go client tests (clients/go, host + CUDA daemons)",
                                            "Go Ollama package tests (clients/go/ollama)",
                                            "C client integration tests on the CUDA backend (clients/c/tests)")]
if len(progs) != 3:
    bad.append(f"stage 2: {len(progs)} test program rows, want 3 (Go client, Go Ollama, C integration)")
s3 = by(3)
if not s3:
    bad.append("stage 3: no rows")
for r in s3:
    if r["verdict"] != "skip" or "no CUDA runtime" not in r["seen"]:
        bad.append(f"stage 3: {r['check']}: {r['verdict']}: {r['seen']} (want skip: no CUDA runtime)")
if not by(4):
    bad.append("stage 4: no rows")
for r in by(4):
    if r["verdict"] == "FAIL":
        bad.append(f"stage 4: {r['check']}: FAIL: {r['seen']}")
# stage 5: the scaled CPU scenario when the CPU builds are there, else skip rows
s5 = by(5)
if not s5:
    bad.append("stage 5: no rows")
for r in s5:
    if r["verdict"] == "FAIL":
        bad.append(f"stage 5: {r['check']}: FAIL: {r['seen']}")
if os.environ.get("STAGE5_CPU", "0") != "0":
    got = {r["check"].removeprefix("cpu, scaled: "): r for r in s5}
    for name in ("kvcached, 1 slot: models resident", "1 slot: every resident model answers, round robin twice",
                 "1 slot: greedy tokens identical to stock"):
        if got.get(name, {}).get("verdict") != "pass":
            bad.append(f"stage 5: {name}: {got.get(name, {}).get('verdict', 'missing')}, want pass")
    figs = res.get("figures", {})
    k, s = figs.get("stage5.models_resident_kvcached_np1", {}).get("value", 0), figs.get("stage5.models_resident_stock_np1", {}).get("value", 0)
    if not k > s > 0:
        bad.append(f"stage 5: models resident kvcached {k}, stock {s}: want kvcached > stock > 0")
else:
    for r in s5:
        if r["verdict"] != "skip":
            bad.append(f"stage 5: {r['check']}: {r['verdict']} (no CPU builds: want skip rows)")
if last != "PASS":
    bad.append(f"verify.sh's last line: {last!r}, want PASS")
print()
print(f"test-gpu-bundle: {len(rows)} rows; stage 1 {len(by(1))}, stage 2 {len(by(2))}, stage 3 {len(s3)}, stage 4 {len(by(4))}, stage 5 {len(s5)}; verdict {res['verdict']}")
for b in bad:
    print("test-gpu-bundle: FAIL " + b)
sys.exit(1 if bad else 0)
EOF
echo "test-gpu-bundle: passed (bundle $((t1 - t0)) s, verify.sh $((t2 - t1)) s; results in $DRY/out)"
