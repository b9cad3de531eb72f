#!/usr/bin/env bash
# Install Ollama with kvcached from a release tarball (docs/ollama.md, "Install"):
#
#   sudo integrations/ollama/install.sh [--prefix DIR] [--root DIR] [--no-start] TARBALL
#   sudo integrations/ollama/install.sh [--prefix DIR] [--root DIR] --uninstall
#
# What Ollama's own install script does for a Linux host, from a tarball
# made by integrations/ollama/dist.sh instead of a download:
#   - checks TARBALL against TARBALL.sha256 when that file is there;
#   - unpacks bin/ollama and lib/ollama/ into PREFIX (default /usr/local),
#     replacing an older lib/ollama as Ollama's script does;
#   - creates the `ollama` user and group (useradd -r -s /bin/false -U -m -d
#     /usr/share/ollama) and adds it to the render and video groups where
#     they exist;
#   - writes /etc/systemd/system/ollama.service (Ollama's unit, ExecStart
#     PREFIX/bin/ollama serve);
# and this project's part:
#   - the `kvcached` system user (group ollama: the sockets' group), the
#     kvcached-serve unit (deploy/systemd/kvcached.service), its default
#     settings file (/etc/default/kvcached, kept if present) and the drop-in
#     that points ollama.service at the daemon
#     (/etc/systemd/system/ollama.service.d/kvcached.conf);
#   - with systemd running (and --root /): daemon-reload, enable both units,
#     start them unless --no-start.
# kvcached-serve itself comes from the kvcached-service package (README,
# "Installing"); the unit runs PREFIX/bin/kvcached-serve, and the script
# says so when it is missing.
#
# A stock Ollama already installed there (bin/ollama, lib/ollama,
# ollama.service) is kept aside in ROOT/var/lib/ollama-kvcached/stock and put
# back by --uninstall, which removes everything this script added (files,
# directories, the users it created: listed in
# ROOT/var/lib/ollama-kvcached/manifest) and nothing else.
#
#   --root DIR   install into DIR as if it were / (a scratch root, an image
#                being built); users go to DIR/etc/passwd (useradd --root),
#                systemd is not touched
#   --no-start   enable the units but do not start them
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
UNITS="$REPO/deploy/systemd"
PREFIX=/usr/local; ROOT=/; UNINSTALL=0; START=1; TARBALL=""
die() { echo "install.sh: $*" >&2; exit 1; }
say() { echo ">>> $*"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --prefix) PREFIX="$2"; shift 2 ;;
    --root) ROOT="$2"; shift 2 ;;
    --uninstall) UNINSTALL=1; shift ;;
    --no-start) START=0; shift ;;
    -h|--help) sed -n '2,38p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option $1 (--help)" ;;
    *) [[ -z "$TARBALL" ]] || die "one tarball only"; TARBALL="$1"; shift ;;
  esac
done
[[ "$(id -u)" == 0 ]] || die "run as root (sudo): it installs into $PREFIX and creates users and units"
[[ "$PREFIX" == /* ]] || die "--prefix $PREFIX: an absolute path"
[[ -d "$ROOT" ]] || die "--root $ROOT does not exist"
ROOT="$(cd "$ROOT" && pwd)"
R="${ROOT%/}"  # "" for /
STATE="$R/var/lib/ollama-kvcached"
MANIFEST="$STATE/manifest"
SYSTEMD_UNITS="$R/etc/systemd/system"
USERADD=(useradd); USERDEL=(userdel); USERMOD=(usermod); GETENT() { getent "$@"; }
if [[ -n "$R" ]]; then
  USERADD+=(--root "$ROOT"); USERDEL+=(--root "$ROOT"); USERMOD+=(--root "$ROOT")
  GETENT() { grep -q "^$2:" "$R/etc/$1" 2>/dev/null; }
fi
systemd_live() { [[ -z "$R" ]] && command -v systemctl >/dev/null && systemctl is-system-running 2>/dev/null | grep -Eq 'running|degraded'; }

# ---- uninstall ---------------------------------------------------------------------
if [[ $UNINSTALL == 1 ]]; then
  [[ -f "$MANIFEST" ]] || die "nothing to uninstall: no $MANIFEST"
  if systemd_live; then
    systemctl disable --now kvcached.service >/dev/null 2>&1 || true
    systemctl stop ollama.service >/dev/null 2>&1 || true
  fi
  # files first, then directories deepest first, then users (manifest order reversed)
  tac "$MANIFEST" | while IFS=' ' read -r kind path; do
    case "$kind" in
      file) rm -f "$R$path" ;;
      dir) rmdir "$R$path" 2>/dev/null || true ;;  # only if empty: never what someone else put there
      home) rmdir "$R$path" 2>/dev/null || say "kept $path: it is not empty (models pulled as the service?); remove it yourself" ;;
      state) ;;  # the manifest's own directories: below
      user) "${USERDEL[@]}" "$path" >/dev/null 2>&1 || say "could not remove user $path" ;;
      group) if GETENT group "$path"; then groupdel ${R:+--root "$ROOT"} "$path" >/dev/null 2>&1 || say "could not remove group $path"; fi ;;
    esac
  done
  if [[ -d "$STATE/stock" ]]; then
    say "putting the stock Ollama back"
    cp -a "$STATE/stock/." "$R/"
    rm -rf "$STATE/stock"
  fi
  state_dirs="$(awk '$1 == "state" {print $2}' "$MANIFEST" | tac)"
  rm -f "$MANIFEST"
  rmdir "$STATE" 2>/dev/null || true
  for d in $state_dirs; do rmdir "$R$d" 2>/dev/null || true; done
  systemd_live && systemctl daemon-reload || true
  say "uninstalled"
  exit 0
fi

# ---- install -----------------------------------------------------------------------
[[ -n "$TARBALL" ]] || die "no tarball given (integrations/ollama/dist.sh makes one)"
[[ -f "$TARBALL" ]] || die "$TARBALL does not exist"
[[ ! -f "$MANIFEST" ]] || die "already installed ($MANIFEST): run --uninstall first"
for f in kvcached.service ollama.service.d/kvcached.conf kvcached.default; do
  [[ -f "$UNITS/$f" ]] || die "$UNITS/$f is missing (run this script from a kvcached-service checkout)"
done
if [[ -f "$TARBALL.sha256" ]]; then
  (cd "$(dirname "$TARBALL")" && sha256sum --quiet -c "$(basename "$TARBALL").sha256") \
    || die "$TARBALL does not match $TARBALL.sha256"
  say "checksum ok"
fi
tar -tzf "$TARBALL" ./bin/ollama >/dev/null 2>&1 || die "$TARBALL has no ./bin/ollama: not an Ollama Linux tarball"

state_made=()
d="${STATE#"$R"}"
while [[ ! -d "$R$d" ]]; do state_made=("$d" "${state_made[@]}"); d="$(dirname "$d")"; done
mkdir -p "$STATE"
: > "$MANIFEST.new"
record() { echo "$1 $2" >> "$MANIFEST.new"; }
for d in "${state_made[@]}"; do [[ "$d" == "${STATE#"$R"}" ]] || record state "$d"; done
# directories this install creates (recorded so --uninstall removes them when empty)
mkdirs() {
  local d="$1" missing=()
  while [[ ! -d "$R$d" ]]; do missing=("$d" "${missing[@]}"); d="$(dirname "$d")"; done
  for d in "${missing[@]}"; do mkdir -m 755 "$R$d"; record dir "$d"; done
}
keep_stock() {  # a file or directory of a previous install: aside, for --uninstall to put back
  local p="$1"
  [[ -e "$R$p" ]] || return 0
  mkdir -p "$STATE/stock$(dirname "$p")"
  mv "$R$p" "$STATE/stock$p"
  say "kept the existing $p for --uninstall"
}

keep_stock "$PREFIX/bin/ollama"
keep_stock "$PREFIX/lib/ollama"
mkdirs "$PREFIX/bin"
mkdirs "$PREFIX/lib/ollama"
say "installing ollama to $PREFIX"
tar -C "$R$PREFIX" --no-same-owner -xzf "$TARBALL" ./bin/ollama ./lib/ollama
tar -tzf "$TARBALL" ./lib/ollama | sed -e 's|^\./||' -e 's|/$||' | while read -r f; do
  [[ "$f" == lib/ollama ]] && continue  # made above
  if [[ -d "$R$PREFIX/$f" ]]; then record dir "$PREFIX/$f"; else record file "$PREFIX/$f"; fi
done
record file "$PREFIX/bin/ollama"

if ! GETENT passwd ollama; then
  GETENT group ollama || record group ollama  # useradd -U makes it; userdel leaves it where USERGROUPS_ENAB is off
  say "creating the ollama user"
  "${USERADD[@]}" -r -s /bin/false -U -M -d /usr/share/ollama ollama
  record user ollama
  mkdirs /usr/share
  if [[ ! -d "$R/usr/share/ollama" ]]; then  # its home (models go there): made without skel files
    mkdir -m 755 "$R/usr/share/ollama"
    chown "$(grep '^ollama:' "$R/etc/passwd" | cut -d: -f3,4)" "$R/usr/share/ollama"
    record home /usr/share/ollama
  fi
fi
for g in render video; do
  if GETENT group "$g"; then "${USERMOD[@]}" -a -G "$g" ollama; fi
done
if ! GETENT passwd kvcached; then
  say "creating the kvcached user (group ollama: the daemon's sockets are group ollama, 0660)"
  "${USERADD[@]}" -r -s /usr/sbin/nologin -g ollama -M -d /var/lib/kvcached kvcached
  record user kvcached
fi

mkdirs /etc/systemd/system/ollama.service.d
keep_stock /etc/systemd/system/ollama.service
say "writing the units"
cat > "$SYSTEMD_UNITS/ollama.service" <<EOF
[Unit]
Description=Ollama Service
After=network-online.target

[Service]
ExecStart=$PREFIX/bin/ollama serve
User=ollama
Group=ollama
Restart=always
RestartSec=3
Environment="PATH=$PATH"

[Install]
WantedBy=default.target
EOF
record file /etc/systemd/system/ollama.service
sed "s|/usr/local/bin/kvcached-serve|$PREFIX/bin/kvcached-serve|" "$UNITS/kvcached.service" > "$SYSTEMD_UNITS/kvcached.service"
record file /etc/systemd/system/kvcached.service
cp "$UNITS/ollama.service.d/kvcached.conf" "$SYSTEMD_UNITS/ollama.service.d/kvcached.conf"
record file /etc/systemd/system/ollama.service.d/kvcached.conf
if [[ ! -f "$R/etc/default/kvcached" ]]; then
  mkdirs /etc/default
  cp "$UNITS/kvcached.default" "$R/etc/default/kvcached"
  record file /etc/default/kvcached
fi
mv "$MANIFEST.new" "$MANIFEST"

[[ -x "$R$PREFIX/bin/kvcached-serve" ]] || say "note: $PREFIX/bin/kvcached-serve is not there yet: install the kvcached-service package (README, \"Installing\") before starting kvcached.service"
if systemd_live; then
  systemctl daemon-reload
  systemctl enable kvcached.service ollama.service >/dev/null
  if [[ $START == 1 ]]; then
    systemctl restart kvcached.service ollama.service && say "kvcached and ollama started"
  fi
else
  say "systemd is not running here (or --root was given): start kvcached-serve and then ollama serve yourself"
fi
say "installed (undo: $0${R:+ --root $ROOT} --prefix $PREFIX --uninstall)"
