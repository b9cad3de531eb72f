"""kvcachedctl: the command-line tool for people running kvcached-serve.

See `kvcachedctl --help` and docs/operations.md."""

from .cli import main

__all__ = ["main"]
