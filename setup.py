"""The one part of kvcached-service that is compiled: the control socket's
byte relay (kvcached_service/server/transports/relay.c), a plain C library loaded with
ctypes (kvcached_service/server/transports/relay.py), not a Python extension. It uses
no Python API, so one build serves every CPython >= 3.10 (the abi3 file
name and wheel tag), and it needs glibc 2.17 or later (the packaging suite
repairs the wheel to manylinux_2_17 with auditwheel). Everything else is in
pyproject.toml.
"""

import os

from setuptools import Extension, setup


def _pthread() -> dict:
    """On glibc: libpthread.so.0 NEEDED even where --as-needed is the
    default, since on a glibc older than 2.34 the pthread calls live there
    (relay.c binds them to their original symbol versions for
    manylinux_2_17). Elsewhere (musl) the plain -lpthread."""
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        libc = ""
    if libc.startswith("glibc"):
        return {"extra_link_args": ["-Wl,--no-as-needed", "-l:libpthread.so.0"]}
    return {"libraries": ["pthread"]}


setup(
    ext_modules=[
        Extension(
            "kvcached_service.server.transports._relay",
            ["kvcached_service/server/transports/relay.c"],
            py_limited_api=True,
            extra_compile_args=["-O2", "-Wall"],
            **_pthread(),
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
