#!/usr/bin/env bash
# Build the CUDA test driver (tests/cudadriver/) into build/testdriver/libcuda.so.1.
#
# It is compiled against NVIDIA's own cuda.h from the pinned PyPI wheel
# nvidia-cuda-runtime (see pyproject.toml, dev extra), with -Werror, so a
# prototype or struct that differs from the real header does not build.
# The header is taken from the venv's installed wheel when present, else the
# pinned wheel is downloaded into build/ (pip download; no install).
#
# Idempotent: rebuilds only when a source, the header or this script changed.
# Recovers from its own failures: the library is linked to a .tmp and renamed
# into place, and the stamp is written after it, so a compile that failed or
# was stopped is redone by the next run; the pinned header likewise.
# Never installs anything system-wide. Prints the library path last.
# `--include-dir` prints the directory holding cuda.h instead of building.
# `--pinned-header` prints build/cuda-runtime-<pin>/nvidia/cu13/include/cuda.h,
# the place looked in when the venv has no such wheel, copying the header
# found there first (the GPU bundle carries it: its host cannot download it).
# `--public-only` builds build/testdriver-public/libcuda.so.1 instead: the
# same driver without its private features (no KVCACHED_TESTDRV_* knob,
# state directory, leak report or fault injection is read), a stand-in for
# "another libcuda" to point the suites at (KVCACHED_TEST_LIBCUDA).
set -euo pipefail

PUBLIC_ONLY=0
if [[ "${1:-}" == "--public-only" ]]; then
    PUBLIC_ONLY=1
    shift
fi

CUDA_RUNTIME_VERSION="13.2.86"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="$REPO/tests/cudadriver"
OUT="$REPO/build/testdriver"
[[ $PUBLIC_ONLY == 1 ]] && OUT="$REPO/build/testdriver-public"
CC="${CC:-cc}"
PINNED_DIR="$REPO/build/cuda-runtime-$CUDA_RUNTIME_VERSION"   # the pinned wheel's header, extracted
PINNED_HDR="$PINNED_DIR/nvidia/cu13/include/cuda.h"
mkdir -p "$OUT"

find_header() {
    local py="$REPO/.venv/bin/python"
    if [[ -x "$py" ]]; then
        local h
        h="$("$py" - <<'EOF' 2>/dev/null || true
import importlib.metadata as md, pathlib
try:
    dist = md.distribution("nvidia-cuda-runtime")
except md.PackageNotFoundError:
    raise SystemExit(0)
for f in dist.files or []:
    if str(f).endswith("include/cuda.h"):
        print(pathlib.Path(dist.locate_file(f)).resolve())
        break
EOF
)"
        if [[ -n "$h" && -f "$h" ]]; then
            local v
            v="$("$py" -c 'import importlib.metadata as m; print(m.version("nvidia-cuda-runtime"))')"
            if [[ "$v" == "$CUDA_RUNTIME_VERSION" ]]; then
                echo "$h"
                return
            fi
            echo "build-testdriver: venv has nvidia-cuda-runtime $v, want $CUDA_RUNTIME_VERSION; using the pinned wheel" >&2
        fi
    fi
    local dir="$PINNED_DIR" hdr="$PINNED_HDR"
    if [[ ! -f "$hdr" ]]; then
        # downloaded into a folder of its own and the headers extracted beside
        # the final place, then renamed into it: a download or extraction that
        # failed or was stopped leaves no cuda.h, and the next run does it again
        local pip="$REPO/.venv/bin/pip" tmp="$dir.tmp"
        [[ -x "$pip" ]] || pip="python3 -m pip"
        rm -rf "$tmp" "$dir"
        mkdir -p "$REPO/build/wheels" "$tmp/dl"
        $pip download --quiet --no-deps --only-binary=:all: \
            --platform manylinux2014_x86_64 --python-version 3.11 \
            -d "$tmp/dl" "nvidia-cuda-runtime==$CUDA_RUNTIME_VERSION" >&2
        local whl
        whl="$(ls "$tmp"/dl/nvidia_cuda_runtime-"$CUDA_RUNTIME_VERSION"-*.whl | head -1)"
        python3 - "$whl" "$tmp/x" <<'EOF'
import sys, zipfile
whl, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        if n.startswith("nvidia/cu13/include/"):
            z.extract(n, dest)
EOF
        mv -f "$whl" "$REPO/build/wheels/"
        mv "$tmp/x" "$dir"
        rm -rf "$tmp"
    fi
    echo "$hdr"
}

HDR="$(find_header)"
if [[ ! -f "$HDR" ]]; then
    echo "build-testdriver: cuda.h not found (nvidia-cuda-runtime==$CUDA_RUNTIME_VERSION)" >&2
    exit 1
fi
INC="$(dirname "$HDR")"
if [[ "${1:-}" == "--pinned-header" ]]; then
    if [[ "$HDR" != "$PINNED_HDR" ]]; then
        mkdir -p "$(dirname "$PINNED_HDR")" && cp "$HDR" "$PINNED_HDR.tmp" && mv "$PINNED_HDR.tmp" "$PINNED_HDR"
    fi
    echo "$PINNED_HDR"
    exit 0
fi
if [[ "${1:-}" == "--include-dir" ]]; then
    # where cuda.h is (tests compile against the same header)
    echo "$INC"
    exit 0
fi

LIB="$OUT/libcuda.so.1"
STAMP="$OUT/.stamp"
want_stamp="$(cat "$SRC/testdriver.c" "$SRC/exports.txt" "$HDR" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1) $CC public=$PUBLIC_ONLY"
if [[ -f "$LIB" && -f "$STAMP" && "$(cat "$STAMP")" == "$want_stamp" ]]; then
    echo "$LIB"
    exit 0
fi

# The CUresult table (name + first sentence of the header's description),
# generated from the header itself so cuGetErrorName/String cannot drift.
awk '
    /typedef enum cudaError_enum/ { inside = 1; next }
    inside && /} CUresult;/ { exit }
    !inside { next }
    /\/\*\*/ { doc = ""; indoc = 1; next }
    indoc && /\*\// { indoc = 0; next }
    indoc {
        line = $0
        sub(/^[ \t]*\*[ \t]?/, "", line)
        if (line ~ /^\\deprecated/) next
        doc = doc (doc == "" ? "" : " ") line
        next
    }
    /^[ \t]*CUDA_[A-Z0-9_]+[ \t]*=/ {
        name = $1
        gsub(/::/, "", doc); gsub(/\\p /, "", doc); gsub(/\\/, "", doc); gsub(/"/, "\x27", doc)
        desc = doc
        i = index(desc, ". ")
        if (i > 0) desc = substr(desc, 1, i)
        printf "    TD_ERR(%s, \"%s\")\n", name, desc
        doc = ""
    }
' "$HDR" > "$OUT/cu_errors.inc.tmp"
mv "$OUT/cu_errors.inc.tmp" "$OUT/cu_errors.inc"

CFLAGS=(-std=gnu11 -O2 -g -fPIC -fvisibility=hidden
        -Wall -Wextra -Werror -Wmissing-prototypes -Wstrict-prototypes -Wshadow
        -Wno-format-truncation
        -D__CUDA_API_PUSH_VISIBILITY_DEFAULT
        -I"$INC" -I"$OUT")
if [[ $PUBLIC_ONLY == 1 ]]; then CFLAGS+=(-DKVCACHED_TESTDRV_PUBLIC_ONLY); fi
"$CC" "${CFLAGS[@]}" -shared -o "$LIB.tmp" "$SRC/testdriver.c" \
    -Wl,-soname,libcuda.so.1 -Wl,-z,defs -Wl,--no-undefined -lpthread

# The library exports exactly the driver API the project uses, nothing else.
expected="$SRC/exports.txt"
actual="$(nm -D --defined-only "$LIB.tmp" | awk '$2 == "T" { print $3 }' | sort)"
if ! diff <(grep -v '^#' "$expected" | sed '/^$/d' | sort) <(echo "$actual") >&2; then
    echo "build-testdriver: exported symbols differ from $expected (< expected, > built)" >&2
    rm -f "$LIB.tmp"
    exit 1
fi
mv "$LIB.tmp" "$LIB"
echo "$want_stamp" > "$STAMP"
echo "$LIB"
