"""Page backends: `host` (memfd) and `cuda` (driver VMM API), as a table.

This module is the one place the daemon decides which backend serves: a
registry of name -> factory, the order in which `--backend auto` tries them,
and the backend it falls back to (host) with the log line that says so.
config.py validates `--backend` against it and server/ops/main.py asks it for
the backend. Importing it imports no backend: each factory imports its
module when called, so a host without a GPU driver never loads one.

A new backend is a module here with `from_settings(settings) -> Backend`
(raising with a message that says why it cannot run) and one `register`
line below; the client side has its own table of mappers
(client/mapping.py), keyed by the DeviceSpec.kind its devices report.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .. import errors

if TYPE_CHECKING:
    from ..config import Settings
    from .base import Backend

log = logging.getLogger("kvcached")

AUTO = "auto"

Factory = Callable[["Settings"], "Backend"]


@dataclass(frozen=True)
class BackendEntry:
    """One registered backend.

    name: the `--backend` value.
    summary: what its pages are, in the start-up log line ("memfd pages").
    factory: settings -> Backend; raises when the backend cannot run here,
      with a message that says why.
    what: what must be usable for it ("CUDA driver"): "--backend cuda: the
      CUDA driver is not usable: ..." and, under auto, "no usable CUDA
      driver (...)".
    auto: `--backend auto` tries it (in registration order).
    fallback: what auto serves when none of the auto ones can run (one
      backend, host); `note` ends the log line that says so.
    """

    name: str
    summary: str
    factory: Factory
    what: str = ""
    auto: bool = False
    fallback: bool = False
    note: str = ""


class BackendUnusable(Exception):
    """The configured backend cannot run here; the message says why."""


_REGISTRY: dict[str, BackendEntry] = {}


def register(name: str, factory: Factory, *, summary: str, what: str = "", auto: bool = False,
             fallback: bool = False, note: str = "") -> BackendEntry:
    """Add (or replace) a backend. Returns its entry."""
    if name == AUTO or not name:
        raise ValueError(f"a backend cannot be called {name!r}")
    if fallback and any(e.fallback for e in _REGISTRY.values() if e.name != name):
        raise ValueError(f"backend {name!r}: there is a fallback backend already ({fallback_entry().name})")
    entry = BackendEntry(name, summary, factory, what or name, auto, fallback, note)
    _REGISTRY[name] = entry
    return entry


def unregister(name: str) -> None:
    """Drop a backend (tests that registered one)."""
    _REGISTRY.pop(name, None)


def lazy(module: str, attr: str = "from_settings") -> Factory:
    """A factory that imports `module` (relative to this package) on first
    use and calls its `attr`."""

    def factory(settings: "Settings") -> "Backend":
        return getattr(importlib.import_module(module, __name__), attr)(settings)

    factory.__qualname__ = f"lazy({module!r}, {attr!r})"
    return factory


def names() -> list[str]:
    """The registered backends, in registration order."""
    return list(_REGISTRY)


def choices() -> list[str]:
    """Every value `--backend` takes: auto, then the backends."""
    return [AUTO, *_REGISTRY]


def entry(name: str) -> BackendEntry:
    return _REGISTRY[name]


def auto_order() -> list[BackendEntry]:
    """The backends `--backend auto` tries, in order, before the fallback."""
    return [e for e in _REGISTRY.values() if e.auto]


def fallback_entry() -> BackendEntry:
    for e in _REGISTRY.values():
        if e.fallback:
            return e
    raise LookupError("no fallback backend is registered")


def auto_help() -> str:
    """`--backend`'s help: "auto = cuda if usable, else host"."""
    tried = ", then ".join(e.name for e in auto_order())
    fb = next((e.name for e in _REGISTRY.values() if e.fallback), "")
    return f"page backend; auto = {tried} if usable, else {fb}" if tried else f"page backend; auto = {fb}"


def quoted_choices() -> str:
    """"'auto', 'host' or 'cuda'" (pydantic's wording for a Literal)."""
    q = [repr(c) for c in choices()]
    return q[0] if len(q) == 1 else ", ".join(q[:-1]) + " or " + q[-1]


def _reason(exc: BaseException) -> str:
    if isinstance(exc, errors.KVCachedError):
        return exc.message
    return f"{type(exc).__name__}: {exc}"


def _started(e: BackendEntry, backend: "Backend") -> "Backend":
    if e.fallback:
        log.info("backend: %s (%s), as configured", e.name, e.summary)
    else:
        log.info("backend: %s (%s), %d device(s)", e.name, e.summary, len(backend.devices()))
    return backend


def open_backend(name: str, settings: "Settings") -> "Backend":
    """The backend `name` (a registered one or auto) made from `settings`.

    A named backend that cannot run raises BackendUnusable ("--backend cuda:
    the CUDA driver is not usable: ..."). auto tries auto_order() in turn
    and takes the first that runs; when none does it serves the fallback
    and logs a warning naming why each was passed over."""
    if name != AUTO:
        if name not in _REGISTRY:
            raise BackendUnusable(f"--backend {name}: no such backend (choices: {quoted_choices()})")
        e = _REGISTRY[name]
        if e.fallback:  # configured: a failure is the backend's own error, as it always was
            return _started(e, e.factory(settings))
        try:
            backend = e.factory(settings)
        except Exception as exc:  # noqa: BLE001 - any reason it cannot run
            raise BackendUnusable(f"--backend {name}: the {e.what} is not usable: {_reason(exc)}") from None
        return _started(e, backend)
    passed: list[str] = []
    for e in auto_order():
        try:
            backend = e.factory(settings)
        except Exception as exc:  # noqa: BLE001 - any reason it cannot run: try the next
            passed.append(f"no usable {e.what} ({_reason(exc)})")
            continue
        return _started(e, backend)
    fb = fallback_entry()
    backend = fb.factory(settings)
    log.warning("backend: %s (%s): %s", fb.name, fb.summary, "; ".join([*passed, fb.note] if fb.note else passed))
    return backend


# ---- the backends ------------------------------------------------------
# One line per backend. auto tries the auto ones in this order.
register("host", lazy(".host"), summary="memfd pages", what="host memory", fallback=True,
         note="serving host memory instead of GPU memory")
register("cuda", lazy(".cuda"), summary="driver VMM API", what="CUDA driver", auto=True)
