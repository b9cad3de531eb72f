#!/usr/bin/env bash
# Coverage-guided fuzzing of every decoder (docs/fuzzing.md): seven targets,
#   fdchannel, journal, keeper_names, keeper_records, config   Python, atheris (tests/fuzz/run.py)
#   c_fdchannel                                                C client, libFuzzer + ASan + UBSan (tests/fuzz/c)
#   go_fdchannel                                               Go client, go test -fuzz (clients/go/internal/fdchan)
# each seeded with the shared wire vectors (or fixtures) and its committed
# corpus (tests/fuzz/corpus/TARGET). Any crash, hang (an input over -timeout
# seconds) or memory over the limits fails the run; libFuzzer leaves the
# input in build/fuzz/artifacts/.
#
#   scripts/test-fuzz.sh                 short run of every target, about 60 s
#                                        of fuzzing in all (make test-fuzz)
#   scripts/test-fuzz.sh --long SECONDS  every target at once, at nice 10, for
#                                        SECONDS each, writing new inputs into
#                                        build/fuzz/long/TARGET; logs and
#                                        figures in build/fuzz/long/
#   scripts/test-fuzz.sh --merge         minimise: each committed corpus
#                                        becomes the smallest set of its files
#                                        and build/fuzz/long/TARGET's with the
#                                        same coverage (libFuzzer -merge=1)
#   scripts/test-fuzz.sh --build-only    install and build, fuzz nothing
#                                        (scripts/prebuild.sh's step fuzz)
#   FUZZ_TARGETS="journal config" limits any mode to those targets.
#
# Installs what it needs: clang (Debian's, for libFuzzer) and atheris (PyPI,
# into .venv). Needs .venv (scripts/setup.sh) and go.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
MODE=short LONG=0
case "${1:-}" in
  --long) MODE=long LONG="${2:?--long SECONDS}" ;;
  --merge) MODE=merge ;;
  --build-only) MODE=build ;;
  "") ;;
  *) echo "usage: scripts/test-fuzz.sh [--long SECONDS | --merge | --build-only]" >&2; exit 2 ;;
esac
ATHERIS=atheris==3.0.0
PY_TARGETS=(fdchannel journal keeper_names keeper_records config)
ALL=(fdchannel journal keeper_names keeper_records config c_fdchannel go_fdchannel)
read -r -a TARGETS <<<"${FUZZ_TARGETS:-${ALL[*]}}"
# seconds of the short run per target (about 60 in all)
declare -A SHORT=([fdchannel]=8 [journal]=9 [keeper_names]=7 [keeper_records]=7 [config]=10 [c_fdchannel]=7 [go_fdchannel]=12)
# per-target input size limit (bytes): the fd channel's largest record is a
# FREE of 16,384 ids (131,104 bytes)
declare -A MAXLEN=([fdchannel]=140000 [journal]=16384 [keeper_names]=4096 [keeper_records]=66000 [config]=4096 [c_fdchannel]=140000)
B="$ROOT/build/fuzz"
mkdir -p "$B/artifacts" "$B/seeds"
log() { printf '\033[1m[fuzz]\033[0m %s\n' "$*"; }

# ---- what it needs
apt_install() {
  local SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  log "installing $* (Debian)"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$@" >/dev/null \
    || { echo "test-fuzz: could not install $*" >&2; exit 1; }
}
command -v clang >/dev/null || apt_install clang
# libFuzzer's runtime is libclang-rt-N-dev, only a recommendation of clang's
# packages (setup.sh installs none)
if ! echo 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { return 0; }' \
     | clang -x c -fsanitize=fuzzer - -o "$B/probe" 2>/dev/null; then
  apt_install "libclang-rt-$(clang -dumpversion | cut -d. -f1)-dev"
fi
rm -f "$B/probe"
if ! .venv/bin/python -c 'import atheris' 2>/dev/null; then
  log "installing $ATHERIS into .venv"
  .venv/bin/pip install -q "$ATHERIS" || { echo "test-fuzz: could not install $ATHERIS" >&2; exit 1; }
fi
want() { [[ " ${TARGETS[*]} " == *" $1 "* ]]; }
if want c_fdchannel; then
  bin="$B/c/fuzz_fdchannel"
  src=(tests/fuzz/c/fuzz_fdchannel.c clients/c/src/fdchannel.c)
  if [[ ! -x "$bin" ]] || [[ -n "$(find "${src[@]}" clients/c/src/fdchannel.h clients/c/include/kvcached.h -newer "$bin")" ]]; then
    log "building the C target (clang -fsanitize=fuzzer,address,undefined)"
    mkdir -p "$B/c"
    nice clang -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
      -Iclients/c/include -Iclients/c/src "${src[@]}" -o "$bin" || { echo "test-fuzz: the C target did not build" >&2; exit 1; }
  fi
fi
if want fdchannel; then
  # the C decoder as a shared library: the Python target's differential check
  so="$B/c/libkvcfd.so"
  if [[ ! -f "$so" ]] || [[ -n "$(find tests/fuzz/c/classify.c clients/c/src/fdchannel.[ch] clients/c/include/kvcached.h -newer "$so")" ]]; then
    mkdir -p "$B/c"
    gcc -O1 -shared -fPIC -Iclients/c/include -Iclients/c/src tests/fuzz/c/classify.c clients/c/src/fdchannel.c -o "$so" \
      || { echo "test-fuzz: the C decoder library did not build" >&2; exit 1; }
  fi
fi
# seeds of every target from the shared vectors and fixtures (the Go target
# reads the vectors itself)
.venv/bin/python - <<'EOF' || exit 1
import sys; sys.path.insert(0, "tests/fuzz")
import targets
from pathlib import Path
for t in targets.TARGETS:
    targets.write_seeds(t, Path("build/fuzz/seeds") / t)
EOF
ln -sfn fdchannel "$B/seeds/c_fdchannel"
if [[ $MODE == build ]]; then
  # Go's fuzzing build (every package instrumented for coverage: about 50 s
  # cold on 2 cores), kept in Go's build cache; one input run
  want go_fdchannel && { (cd clients/go && go test ./internal/fdchan/ -run '^$' -fuzz '^FuzzDecode$' -fuzztime 1x -parallel 1) || exit 1; }
  exit 0
fi

# ---- one target: run_target TARGET SECONDS WORKDIR (new inputs go to WORKDIR)
LF_FLAGS=(-timeout=10 -rss_limit_mb=2048 -print_final_stats=1 -detect_leaks=0)
run_target() {
  local t="$1" secs="$2" work="$3" corpus="tests/fuzz/corpus/$1"
  mkdir -p "$work" "$corpus"
  local common=("${LF_FLAGS[@]}" -max_total_time="$secs" -max_len="${MAXLEN[$t]:-4096}" -artifact_prefix="$B/artifacts/$t-")
  case "$t" in
    c_fdchannel)
      ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=0" "$B/c/fuzz_fdchannel" "${common[@]}" -malloc_limit_mb=512 \
        "$work" "$corpus" "$B/seeds/fdchannel" ;;
    go_fdchannel)
      # Go's engine keeps its corpus in its cache; a hung input (10 s) or a
      # panic fails the run and is written to testdata/fuzz/FuzzDecode
      (cd clients/go && go test ./internal/fdchan/ -run '^$' -fuzz '^FuzzDecode$' -fuzztime "${secs}s" -parallel 1) ;;
    *)
      .venv/bin/python tests/fuzz/run.py "$t" "${common[@]}" "$work" "$corpus" ;;
  esac
}

summary() { # TARGET LOG: one line of what ran
  local t="$1" f="$2"
  if [[ "$t" == go_fdchannel ]]; then
    local last; last="$(grep -E '^fuzz: elapsed' "$f" | tail -1)"
    printf '%-13s %s; %s\n' "$t" "${last#fuzz: }" "$(grep -E '^(ok|FAIL|---)' "$f" | head -2 | tr '\n' ' ')"
  else
    local done; done="$(grep -E '#[0-9]+\s+DONE' "$f" | tail -1 | sed -E 's/^#([0-9]+)\s+DONE\s+/execs \1 /')"
    printf '%-13s %s%s\n' "$t" "${done:-no DONE line}" "$(grep -qE 'ERROR: libFuzzer|ERROR: AddressSanitizer|runtime error' "$f" && echo ' FINDING' || true)"
  fi
}

status=0
case "$MODE" in
short)
  for t in "${TARGETS[@]}"; do
    work="$B/work/$t"; rm -rf "$work"
    t0=$SECONDS
    if run_target "$t" "${SHORT[$t]}" "$work" >"$B/$t.log" 2>&1; then r=passed; else r=FAILED; status=1; fi
    printf '%-7s %3d s  %s\n' "$r" "$((SECONDS - t0))" "$(summary "$t" "$B/$t.log")"
    [[ $r == passed ]] || tail -40 "$B/$t.log"
  done ;;
long)
  mkdir -p "$B/long"
  log "every target for $LONG s at nice 10; logs in build/fuzz/long/"
  pids=()
  for t in "${TARGETS[@]}"; do
    ( nice -n 10 /usr/bin/time -v bash -c "$(declare -f run_target); $(declare -p LF_FLAGS MAXLEN B); run_target $t $LONG $B/long/$t" \
        >"$B/long/$t.log" 2>&1; echo $? >"$B/long/$t.rc" ) &
    pids+=($!)
  done
  wait "${pids[@]}"
  for t in "${TARGETS[@]}"; do
    f="$B/long/$t.log"
    rc="$(cat "$B/long/$t.rc")"; [[ $rc == 0 ]] || status=1
    printf 'exit %s  %s; cpu %s s user + %s s sys; wall %s\n' "$rc" "$(summary "$t" "$f")" \
      "$(grep 'User time' "$f" | awk '{print $NF}')" "$(grep 'System time' "$f" | awk '{print $NF}')" \
      "$(grep 'Elapsed (wall' "$f" | awk '{print $NF}')"
  done | tee "$B/long/summary.txt" ;;
merge)
  for t in "${TARGETS[@]}"; do
    [[ $t == go_fdchannel ]] && { .venv/bin/python tests/fuzz/gocorpus.py || status=1; continue; }
    corpus="tests/fuzz/corpus/$t" new="$B/merged/$t"
    rm -rf "$new"; mkdir -p "$new" "$corpus" "$B/long/$t"
    before="$(ls "$corpus" | wc -l)"
    if [[ $t == c_fdchannel ]]; then
      ASAN_OPTIONS=detect_leaks=0 "$B/c/fuzz_fdchannel" -merge=1 "${LF_FLAGS[@]}" -max_len="${MAXLEN[$t]}" "$new" "$corpus" "$B/long/$t" "$B/seeds/fdchannel" >"$B/merge-$t.log" 2>&1
    else
      .venv/bin/python tests/fuzz/run.py "$t" -merge=1 "${LF_FLAGS[@]}" -max_len="${MAXLEN[$t]}" "$new" "$corpus" "$B/long/$t" "$B/seeds/$t" >"$B/merge-$t.log" 2>&1
    fi || { status=1; tail -20 "$B/merge-$t.log"; continue; }
    [[ -n "$(ls "$new")" ]] || { echo "test-fuzz: merging $t gave nothing: $corpus left as it was (build/fuzz/merge-$t.log)" >&2; status=1; continue; }
    rm -f "$corpus"/*; cp "$new"/* "$corpus"/
    printf '%-13s %4d -> %4d files, %s\n' "$t" "$before" "$(ls "$corpus" | wc -l)" "$(du -sh "$corpus" | cut -f1)"
  done ;;
esac
exit $status
