#!/usr/bin/env bash
# The offline GPU bundle (docs/gpu-check.md "The offline GPU bundle"): a
# folder that proves the daemon, the clients and the llama.cpp hook on a GPU
# host without network, in one command there (OUTDIR/verify.sh).
#
#   scripts/gpu-bundle.sh OUTDIR [--python-version 3.12] [--cuda-arch 90] [--with llama-cuda]
#
# OUTDIR (made anew) gets:
#   verify.sh, tools/   the host's one command and its python helpers
#   parts/repo.tar.xz   the repository's files the stages use, as the working
#                       tree holds them (tracked and untracked files git does
#                       not ignore, less bench results, images, deploy/, CI)
#                       and the test driver's pinned cuda.h (tests/cuda
#                       compile against it; the host cannot download it)
#   parts/wheels.tar.xz wheels for the python version (cp312 manylinux x86-64)
#                       of what such a host lacks, at the versions this
#                       machine's .venv tests: pydantic, pydantic-settings,
#                       gguf, grpcio-health-checking/-reflection, uvloop, ...
#   parts/NAME.tar.xz   what scripts/gpu-bundle/build-NAME.sh built (stage2:
#                       the Go and C test programs; llama: stage 3's llama.cpp;
#                       llama-cuda, only with --with llama-cuda: stage 3's two
#                       llama-servers prebuilt with ggml-cuda for --cuda-arch,
#                       over an hour on 2 cores the first time)
#   MANIFEST.json       commit, date, python version, CUDA arch, each part's
#                       size and input hash
# Each part is cached under build/gpu-bundle/cache by an input hash (its
# build script and the files it declares with "# gpu-bundle-inputs:", else
# the whole repository; the toolchain versions; the options), so a second
# build with the same inputs only copies. A part enters the cache only once
# built and packed whole (renamed into place), and is built in a folder
# emptied first: a part whose build failed or was stopped is built again by
# the next run. The total must be at most 56 MiB
# (GPU_BUNDLE_MAX_MB overrides, for tests): over it, the script fails.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

OUT=""
PYVER=3.12
CUDA_ARCH=90
WITH=()   # optional parts (build scripts marked "# gpu-bundle-optional")
while [[ $# -gt 0 ]]; do
    case "$1" in
        --python-version) PYVER="$2"; shift 2 ;;
        --cuda-arch) CUDA_ARCH="$2"; shift 2 ;;
        --with) WITH+=("$2"); shift 2 ;;
        -h|--help) sed -n '2,/^set -e/{/^#/p}' "$0"; exit 0 ;;
        -*) echo "gpu-bundle: unknown option $1" >&2; exit 2 ;;
        *) [[ -z "$OUT" ]] || { echo "gpu-bundle: one OUTDIR only" >&2; exit 2; }; OUT="$1"; shift ;;
    esac
done
[[ -n "$OUT" ]] || { echo "usage: scripts/gpu-bundle.sh OUTDIR [--python-version 3.12] [--cuda-arch 90] [--with llama-cuda]" >&2; exit 2; }
for w in "${WITH[@]}"; do
    grep -qx '# gpu-bundle-optional' "scripts/gpu-bundle/build-$w.sh" 2>/dev/null \
        || { echo "gpu-bundle: --with $w: no optional part scripts/gpu-bundle/build-$w.sh" >&2; exit 2; }
done
PY="$REPO/.venv/bin/python"
[[ -x "$PY" ]] || { echo "gpu-bundle: $PY missing: run scripts/setup.sh --dev (make setup)" >&2; exit 1; }
PACK="$REPO/scripts/gpu-bundle/pack.py"
CACHE="$REPO/build/gpu-bundle/cache"
MAX_BYTES=$(( ${GPU_BUNDLE_MAX_MB:-56} * 1024 * 1024 ))
export JOBS="${JOBS:-2}" GPU_BUNDLE_PYTHON_VERSION="$PYVER" GPU_BUNDLE_CUDA_ARCH="$CUDA_ARCH"
mkdir -p "$CACHE"

rm -rf "$OUT"
mkdir -p "$OUT/parts" "$OUT/tools"
OUT="$(cd "$OUT" && pwd)"
case "$OUT/" in "$REPO/"*) case "$OUT/" in "$REPO/build/"*) ;; *) echo "gpu-bundle: put OUTDIR outside the repository (or under build/): git would see it" >&2; exit 2 ;; esac ;; esac

declare -A PART_HASH PART_SIZE
# cached NAME HASH: is parts/NAME.tar.xz of this hash in the cache? then copy it
cached() { [[ -f "$CACHE/$1-$2.tar.xz" ]] && cp "$CACHE/$1-$2.tar.xz" "$OUT/parts/$1.tar.xz"; }
store() { # NAME HASH: the new tar.xz into the cache (older ones of NAME removed),
    # under its final name only once whole (a copy stopped half way is a .tmp
    # that no run takes for the part)
    local f
    for f in "$CACHE/$1"-*.tar.xz "$CACHE/$1"-*.tar.xz.tmp; do
        # NAME-<hash> only: llama-cuda-<hash> is another part's, not llama's
        [[ "${f#"$CACHE/$1-"}" == *-* ]] || rm -f "$f"
    done
    cp "$OUT/parts/$1.tar.xz" "$CACHE/$1-$2.tar.xz.tmp"
    mv "$CACHE/$1-$2.tar.xz.tmp" "$CACHE/$1-$2.tar.xz"
}
note() { PART_HASH[$1]="$2"; PART_SIZE[$1]="$(stat -c %s "$OUT/parts/$1.tar.xz")"; printf 'gpu-bundle: part %-8s %7.2f MiB  (%s, input hash %s)\n' "$1" "$(awk -v b="${PART_SIZE[$1]}" 'BEGIN {print b / 1048576}')" "$3" "$2"; }

# ---- repo: the repository's files
# plus NVIDIA's cuda.h of the test driver's pin, where build-testdriver.sh
# looks for it when the venv has no such wheel (a GPU host has no network to
# download it; tests/cuda compile against it)
CUDA_H="$(scripts/build-testdriver.sh --pinned-header | tail -1)"
CUDA_H="${CUDA_H#"$REPO/"}"
REPO_HASH="$("$PY" "$PACK" hash "$REPO" --extra "repo-part-v2 $CUDA_H")"
if cached repo "$REPO_HASH"; then how=cached; else
    LIST="$(mktemp)"; { "$PY" "$PACK" repo-files "$REPO"; echo "$CUDA_H"; } >"$LIST"
    "$PY" "$PACK" tar "$REPO" "$OUT/parts/repo.tar.xz" --list "$LIST" >/dev/null
    rm -f "$LIST"; store repo "$REPO_HASH"; how=built
fi
note repo "$REPO_HASH" "$how"
UNTRACKED="$("$PY" "$PACK" untracked "$REPO")"
[[ -z "$UNTRACKED" ]] || echo "gpu-bundle: the repo part has $(wc -l <<<"$UNTRACKED") files git does not track yet: $(head -5 <<<"$UNTRACKED" | tr '\n' ' ')"

# ---- wheels: what a GPU host's python lacks, pinned to this machine's .venv
# (the host has torch, grpcio, protobuf, prometheus-client, nvidia-ml-py,
# numpy, pytest; pytest-timeout because pyproject.toml sets a timeout).
WHEEL_NAMES=(pydantic pydantic-core pydantic-settings annotated-types typing-extensions typing-inspection
    python-dotenv grpcio-health-checking grpcio-reflection uvloop pytest-timeout
    gguf pyyaml tqdm requests urllib3 idna charset-normalizer certifi grpcio protobuf)
PINS="$("$PY" - "${WHEEL_NAMES[@]}" <<'EOF'
import sys
from importlib.metadata import version, PackageNotFoundError
out = []
for n in sys.argv[1:]:
    try:
        out.append(f"{n}=={version(n)}")
    except PackageNotFoundError:
        sys.exit(f"gpu-bundle: {n} is not in .venv (make setup)")
print(" ".join(out))
EOF
)"
WHEEL_HASH="$("$PY" "$PACK" hash "$REPO" --paths scripts/gpu-bundle.sh --extra "$PINS" "$PYVER" wheels-v2)"
if cached wheels "$WHEEL_HASH"; then how=cached; else
    W="$(mktemp -d)"
    # shellcheck disable=SC2086
    "$PY" -m pip download -q --no-deps --only-binary :all: --dest "$W" --python-version "$PYVER" \
        --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64 $PINS
    n="$(ls "$W"/*.whl | wc -l)"
    [[ "$n" == "${#WHEEL_NAMES[@]}" ]] || { echo "gpu-bundle: $n wheels downloaded for ${#WHEEL_NAMES[@]} packages ($PINS)" >&2; ls "$W" >&2; exit 1; }
    # uncompressed inside, xz 9 over all: 12.1 MB instead of 16.8 (pack.py stored-wheels)
    "$PY" "$PACK" stored-wheels "$W"
    GPU_BUNDLE_XZ_PRESET="${GPU_BUNDLE_XZ_PRESET:-9}" "$PY" "$PACK" tar "$W" "$OUT/parts/wheels.tar.xz" >/dev/null
    rm -rf "$W"; store wheels "$WHEEL_HASH"; how=built
fi
note wheels "$WHEEL_HASH" "$how"

# ---- built parts: scripts/gpu-bundle/build-NAME.sh PARTDIR (stage2 first, the
# optional ones asked for with --with last; each may read the parts before it
# in $GPU_BUNDLE_PARTS)
TOOLS="$(go version 2>/dev/null || true); $(g++ --version 2>/dev/null | head -1); $(cmake --version 2>/dev/null | head -1)"
export GPU_BUNDLE_PARTS="$OUT/parts"
SCRIPTS=(scripts/gpu-bundle/build-stage2.sh)
for script in $(ls scripts/gpu-bundle/build-*.sh | LC_ALL=C sort); do
    [[ "$script" == */build-stage2.sh ]] || grep -qx '# gpu-bundle-optional' "$script" || SCRIPTS+=("$script")
done
for w in "${WITH[@]}"; do SCRIPTS+=("scripts/gpu-bundle/build-$w.sh"); done
for script in "${SCRIPTS[@]}"; do
    name="$(basename "$script" .sh)"; name="${name#build-}"
    read -r -a inputs <<<"$("$PY" "$PACK" inputs "$script")"
    h="$("$PY" "$PACK" hash "$REPO" ${inputs[@]:+--paths "${inputs[@]}" "$script"} --extra "$TOOLS" "$PYVER" "$CUDA_ARCH" "part-v1")"
    if cached "$name" "$h"; then how=cached; else
        P="$REPO/build/gpu-bundle/part-$name"
        rm -rf "$P"; mkdir -p "$P"
        echo "gpu-bundle: building part $name ($script)"
        if ! bash "$script" "$P"; then echo "gpu-bundle: $script failed" >&2; exit 1; fi
        # a script may ask for its own xz preset ("# gpu-bundle-xz: 9": big binaries
        # whose copies a 64 MiB dictionary finds); GPU_BUNDLE_XZ_PRESET overrides all
        preset="$(sed -n 's/^# gpu-bundle-xz: *\([0-9]\).*/\1/p' "$script" | head -1)"
        GPU_BUNDLE_XZ_PRESET="${GPU_BUNDLE_XZ_PRESET:-${preset:-1}}" "$PY" "$PACK" tar "$P" "$OUT/parts/$name.tar.xz" >/dev/null
        rm -rf "$P"; store "$name" "$h"; how=built
    fi
    note "$name" "$h" "$how"
done

# ---- the host's command and its helpers
cp scripts/gpu-bundle/verify.sh "$OUT/verify.sh"
chmod 755 "$OUT/verify.sh"
cp scripts/gpu-bundle/prepare.py scripts/gpu-bundle/report.py scripts/gpu-bundle/runner.py "$OUT/tools/"
"$PY" - "$OUT" "$PYVER" "$CUDA_ARCH" "$PINS" <<EOF
import json, subprocess, sys, datetime
out, pyver, arch, pins = sys.argv[1:5]
git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True).stdout.strip()
parts = {$(for k in "${!PART_HASH[@]}"; do printf '"%s": {"input_hash": "%s", "bytes": %s}, ' "$k" "${PART_HASH[$k]}" "${PART_SIZE[$k]}"; done)}
json.dump({"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain")),
           "built": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "python_version": pyver, "cuda_arch": arch, "wheels": pins.split(), "parts": parts},
          open(out + "/MANIFEST.json", "w"), indent=1)
EOF

"$PY" "$PACK" size "$OUT" --max "$MAX_BYTES"
