#!/usr/bin/env bash
# The Debian bookworm sources the packaging suite's mmdebstrap builds its
# roots from (scripts/test-packaging.sh), in one place for it, the preflight
# and scripts/setup-ops.sh.
#   scripts/bookworm-mirrors.sh           one "deb URL SUITE main" line for each of
#                                         bookworm, bookworm-updates and bookworm-security,
#                                         then "--keyring=FILE" when mmdebstrap must be
#                                         told which keys check them
#   scripts/bookworm-mirrors.sh --check   one line saying which sources; exit 1 when
#                                         their keys are missing ("keyring FILE")
#
# Where apt on this host lists all three (`apt-cache policy`: a Debian 12
# host), its own mirrors, checked with apt's trusted keys: nothing is
# fetched from anywhere apt does not already fetch from. Elsewhere (Ubuntu,
# another Debian release) Debian's mirrors, KVC_PKG_DEBIAN_MIRROR (default
# http://deb.debian.org/debian) and KVC_PKG_DEBIAN_SECURITY_MIRROR (default
# http://deb.debian.org/debian-security), checked with Debian's archive
# keys from the debian-archive-keyring package (Ubuntu packages it in
# universe; scripts/setup-ops.sh installs it). No apt source of the host is
# added or changed.
set -euo pipefail
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
mapfile -t APT < <(apt-cache policy 2>/dev/null \
  | awk '$3 ~ /^bookworm(-updates|-security)?\/main$/ && $4 == "amd64" {split($3, s, "/"); print "deb " $2 " " s[1] " main"}' \
  | sort -u)
SUITES=$(printf '%s\n' "${APT[@]}" | awk 'NF {print $3}' | sort -u | wc -l)
if ((SUITES == 3)) && [[ -z "${KVC_PKG_DEBIAN_MIRROR:-}" ]]; then
  if [[ "${1:-}" == --check ]]; then echo "apt: bookworm, bookworm-updates, bookworm-security"; exit 0; fi
  printf '%s\n' "${APT[@]}"
  exit 0
fi
M="${KVC_PKG_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
S="${KVC_PKG_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
if [[ "${1:-}" == --check ]]; then
  why="apt lists $SUITES of the 3 bookworm sources"
  [[ -z "${KVC_PKG_DEBIAN_MIRROR:-}" ]] || why="KVC_PKG_DEBIAN_MIRROR is set"
  if [[ -f "$KEYRING" ]]; then
    echo "bookworm: $M and $S ($why), checked with $KEYRING"
    exit 0
  fi
  echo "keyring $KEYRING"
  exit 1
fi
printf 'deb %s bookworm main\ndeb %s bookworm-updates main\ndeb %s bookworm-security main\n--keyring=%s\n' "$M" "$M" "$S" "$KEYRING"
