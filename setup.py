"""The one part of kvcached-service that is compiled: the control socket's
byte relay (kvcached_service/server/relay.c), a plain C library loaded with
ctypes (kvcached_service/server/relay.py), not a Python extension. It uses
no Python API, so one build serves every CPython >= 3.10 (the abi3 file
name and wheel tag). Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvcached_service.server._relay",
            ["kvcached_service/server/relay.c"],
            py_limited_api=True,
            extra_compile_args=["-O2", "-Wall"],
            libraries=["pthread"],
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
