"""The README's demo must keep working."""

import subprocess

from kvtest import PY, ROOT


def test_share_page_demo(host_daemon):
    out = subprocess.run(
        [PY, str(ROOT / "examples" / "share_page.py")], env=host_daemon.client_env(), capture_output=True, text=True, timeout=60, check=True
    ).stdout
    lines = out.splitlines()
    written = lines[0].split("wrote ")[1]
    assert lines[1].endswith(f"read from the shared page: {written}")
    assert "in use 0" in lines[2]
