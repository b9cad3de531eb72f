"""Copy the Go fuzz target's corpus out of Go's build cache into
tests/fuzz/corpus/go_fdchannel as raw files (what FuzzDecode's f.Add reads).

go test -fuzz keeps the inputs it found interesting in
$(go env GOCACHE)/fuzz/<package>/FuzzDecode, one file each, in its
"go test fuzz v1" format ([]byte("...") with Go's %q quoting); each of them
was kept for new coverage, so the set is already small. The committed
corpus becomes that set (with what was committed before, deduplicated).
scripts/test-fuzz.sh --merge runs this.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fuzz" / "corpus" / "go_fdchannel"
PKG = "github.com/kvcached/kvcached-service/clients/go/internal/fdchan"
_ESC = {"a": 7, "b": 8, "f": 12, "n": 10, "r": 13, "t": 9, "v": 11, "\\": 92, '"': 34, "'": 39}


def go_bytes(literal: str) -> bytes:
    """The bytes of a Go []byte("...") literal as %q writes it."""
    m = re.fullmatch(r'\[\]byte\("(.*)"\)', literal.strip(), re.S)
    if not m:
        raise ValueError(f"not a []byte literal: {literal[:60]!r}")
    s, out, i = m.group(1), bytearray(), 0
    while i < len(s):
        c = s[i]
        if c != "\\":
            out += c.encode()
            i += 1
            continue
        e = s[i + 1]
        if e == "x":
            out.append(int(s[i + 2:i + 4], 16))
            i += 4
        elif e in "uU":
            n = 4 if e == "u" else 8
            out += chr(int(s[i + 2:i + 2 + n], 16)).encode()
            i += 2 + n
        elif e in "01234567":
            out.append(int(s[i + 1:i + 4], 8))
            i += 4
        else:
            out.append(_ESC[e])
            i += 2
    return bytes(out)


def main() -> int:
    cache = subprocess.run(["go", "env", "GOCACHE"], capture_output=True, text=True, check=True).stdout.strip()
    src = Path(cache) / "fuzz" / PKG / "FuzzDecode"
    files = sorted(src.glob("*")) if src.is_dir() else []
    OUT.mkdir(parents=True, exist_ok=True)
    before = len(list(OUT.iterdir()))
    for f in files:
        lines = f.read_text().splitlines()
        if not lines or lines[0] != "go test fuzz v1":
            continue
        data = go_bytes(lines[1])
        (OUT / hashlib.sha1(data).hexdigest()).write_bytes(data)
    after = list(OUT.iterdir())
    print(f"go_fdchannel  {before} -> {len(after)} files ({len(files)} in Go's cache), {sum(p.stat().st_size for p in after)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
