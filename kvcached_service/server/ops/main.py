"""kvcached-serve: the command line, backend choice, and the server's life.

Exit codes: 0 after a clean shutdown (SIGTERM/SIGINT), 2 for invalid
settings (including a state directory that cannot be read or written), 1
when the daemon cannot start (backend unusable, socket busy). A damaged
journal is not a reason to stop: it is moved aside and the daemon starts
without resumes (recovery/resume.py, Recovery.recover).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import resource
import signal
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ... import __version__, backends, errors
from ..._generated.kvcached.v1 import kvcached_pb2 as pb
from ...backends.base import Backend
from ...config import ConfigError, Settings, load_settings
from ..core.daemon import Daemon, ShutdownIncomplete
from ..host import sdnotify
from ..host.sockets import prepare_socket_path
from ..recovery.resume import Recovery
from ..transports.channel import ChannelServer
from ..transports.control import ControlFront
from ..transports.health import HealthService
from ..transports.relay import RelayUnavailable
from ..transports.service import KVCachedService, add_to_server
from . import systemd
from .metrics import Metrics

log = logging.getLogger("kvcached")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVCached"].full_name


class StartupError(Exception):
    """The daemon cannot start now (exit 1; systemd retries)."""


class SettingsError(Exception):
    """A setting that cannot work as given (exit 2; systemd does not retry:
    RestartPreventExitStatus=2)."""


# retries of a warm pool whose pages could not be created at start-up
WARM_RETRY_FIRST_S = 1.0
WARM_RETRY_MAX_S = 30.0


async def _fill_warm_pools(daemon: Daemon, stop: asyncio.Event) -> None:
    """Return once no device's warm pool has a failed creation pending
    (DevicePool.fill_error), or on a stop; until then retry the creation,
    backing off from WARM_RETRY_FIRST_S to WARM_RETRY_MAX_S. Health stays
    NOT_SERVING meanwhile; clients that come are served as during the fill."""
    delay = WARM_RETRY_FIRST_S
    notifier: sdnotify.Notifier | None = None
    try:
        while not stop.is_set():
            failed = [p for p in daemon.pools.values() if p.fill_error is not None]
            if not failed:
                if notifier is not None:
                    log.info("warm pool filled after retrying: %s", ", ".join(
                        f"{p.uuid} {p.n_ready_total()}/{p.warm_pages} pages" for p in daemon.pools.values() if p.warm_pages))
                return
            reason = "; ".join(f"device {p.uuid}: {p.n_ready_total()}/{p.warm_pages} pages: {p.fill_error}" for p in failed)
            log.error("not serving (health NOT_SERVING): the warm pool (--prealloc) could not be filled: %s; "
                      "retrying in %g s", reason, delay)
            if notifier is None:
                notifier = sdnotify.Notifier.from_env()
            notifier.send("STATUS=not serving: the warm pool could not be filled: " + reason)
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except asyncio.TimeoutError:
                pass
            if stop.is_set():
                return
            await asyncio.gather(*(p.retry_fill() for p in failed))
            delay = min(delay * 2, WARM_RETRY_MAX_S)
    finally:
        if notifier is not None:
            notifier.close()


def _stop_devices(daemon: Daemon, backend: Backend) -> None:
    """Undo start_devices after a failed start."""
    for worker in daemon.workers:
        try:
            worker.stop()
        except Exception as exc:  # noqa: BLE001 - release the rest
            log.warning("stopping a device worker after a failed start: %s", exc)
    daemon.workers.clear()
    backend.close()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvcached-serve",
        description="Per-host GPU memory daemon: lends KV-cache pages to client processes.",
        epilog="Every flag can also be set as KVCACHED_<NAME> in the environment or in the --config TOML file; "
        "flags win over the environment, which wins over the file.",
    )
    ap.add_argument("--config", metavar="FILE", help="TOML file with settings (lowest precedence)")
    ap.add_argument("--print-config", action="store_true", help="print the resolved settings as JSON and exit")
    ap.add_argument("--version", action="version", version=f"kvcached-serve {__version__}")
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_text = field.description or ""
        if field.annotation in (bool, bool | None):
            ap.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            ap.add_argument(flag, dest=name, default=None, metavar=name.upper(), help=help_text)
    return ap


def open_backend(settings: Settings) -> Backend:
    """The backend named by settings.backend; auto = the first usable one of
    the registry's auto order, else host (backends/__init__.py decides)."""
    try:
        return backends.open_backend(settings.backend, settings)
    except backends.BackendUnusable as exc:
        raise StartupError(str(exc)) from None


def raise_fd_limit() -> int:
    """Every host page is one open fd in the daemon (a CUDA page is none,
    but its delivery and the clients' channels are): lift the soft
    RLIMIT_NOFILE to the hard limit. Returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, exc)
    return soft


# Settings a SIGHUP may change in a running daemon: each is read where it is
# used, so the new value applies from the next use. Everything else needs a
# restart (the devices, the budget, the sockets, the state dir, the page size).
RELOADABLE = ("log_level", "fd_send_timeout", "channel_bind_timeout", "default_wait_ms", "max_sessions",
              "max_sessions_per_uid", "max_grpc_connections", "max_grpc_connections_per_uid", "grpc_admin_reserve",
              "max_health_watches_per_uid")


def reload_settings(settings: Settings, load) -> None:
    """SIGHUP: read the settings again (command line, environment, the
    --config file as it is now) and apply the RELOADABLE ones that changed;
    log what changed, what would need a restart, or why nothing was done.
    Never raises: a SIGHUP never stops the daemon."""
    if load is None:
        log.warning("SIGHUP: no settings to reload here; ignored")
        return
    try:
        new = load()
    except ConfigError as exc:
        log.error("SIGHUP: not reloaded, the running settings stay: %s", exc)
        return
    changed = {k: (getattr(settings, k), getattr(new, k)) for k in RELOADABLE if getattr(settings, k) != getattr(new, k)}
    for k, (_, v) in changed.items():
        setattr(settings, k, v)
    if "log_level" in changed:
        logging.getLogger().setLevel(settings.log_level)
    restart = sorted(k for k in Settings.model_fields if k not in RELOADABLE and getattr(settings, k) != getattr(new, k))
    log.warning("SIGHUP: settings reloaded: %s%s",
                ", ".join(f"{k} {old!r} -> {v!r}" for k, (old, v) in changed.items()) or "nothing changed",
                f"; changed but need a restart (kept): {', '.join(restart)}" if restart else "")


async def serve(settings: Settings, ready_hook=None, reload=None) -> int:
    """The daemon's life, as its steps: the core (devices, journal), the
    front door and gRPC, the sockets open and the warm pool filled, ready,
    then on a signal the shutdown. Returns the exit code."""
    nofile = raise_fd_limit()
    backend = open_backend(settings)
    daemon = Daemon(settings, backend)
    channels = ChannelServer(daemon, settings)  # the fd channel adapter, beside the gRPC one
    _start_core(settings, daemon, backend)
    front = _open_front(settings, daemon, backend)
    metrics = Metrics(daemon, control=front) if settings.metrics_address else None
    server, health = await _start_grpc(settings, daemon, front, metrics)
    stop = _stop_on_signals(settings, reload)
    try:
        await front.start()
        channels.start()
        if metrics:
            metrics.start_http(settings.metrics_address)
        await _prefill(daemon, stop)
    except Exception:
        await server.stop(None)
        channels.shutdown(errors.Unavailable("the daemon failed to start"))  # also removes the fd socket file
        front.close()
        raise
    daemon.start_background()
    # A warm pool whose pages could not be created is not filled: health
    # stays NOT_SERVING (the log and systemd's STATUS= say why) and the
    # creation is retried until it works or a signal comes.
    await _fill_warm_pools(daemon, stop)
    notifier = await _announce_ready(settings, daemon, health, stop)
    _warn_fd_limit(daemon, backend, nofile)
    if ready_hook is not None:
        ready_hook(daemon)
    await stop.wait()
    return await _shut_down(daemon, server, health, channels, front, metrics, notifier)


def _start_core(settings: Settings, daemon: Daemon, backend: Backend) -> None:
    """The devices, and what the journal says to restore; a failure is
    StartupError (systemd retries) or SettingsError (it does not), with the
    devices stopped."""
    try:
        daemon.start_devices()
        if settings.state_dir:  # the journal, the orphans, the page store (recovery/)
            recovery = Recovery(settings, daemon.ledger, daemon.identity, daemon.bind)
            daemon.attach_recovery(recovery)
            recovery.recover()
    except errors.KVCachedError as exc:
        _stop_devices(daemon, backend)
        raise StartupError(exc.message) from None
    except ConfigError as exc:  # a setting that cannot work with what the host gives (the fd store's size)
        _stop_devices(daemon, backend)
        raise SettingsError(str(exc)) from None
    except OSError as exc:  # the state directory cannot be used at all: a setting to fix, not to retry
        _stop_devices(daemon, backend)
        raise SettingsError(f"state_dir (--state-dir, KVCACHED_STATE_DIR) {settings.state_dir}: {exc.strerror or exc}"
                            + (f": {exc.filename}" if exc.filename else "")) from None


def _open_front(settings: Settings, daemon: Daemon, backend: Backend) -> ControlFront:
    """The control socket's front door. grpcio listens on a private socket;
    the control socket is the front door's (control.py: per-uid connection
    limits, the caller's uid; relay.c copies the bytes)."""
    prepare_socket_path(settings.socket)
    try:
        return ControlFront(settings)
    except RelayUnavailable as exc:
        _stop_devices(daemon, backend)
        raise StartupError(str(exc)) from None
    except OSError as exc:
        _stop_devices(daemon, backend)
        raise StartupError(f"cannot make grpcio's private socket directory beside {settings.socket}: {exc}") from None


async def _start_grpc(settings: Settings, daemon: Daemon, front: ControlFront,
                      metrics: Metrics | None) -> tuple[grpc.aio.Server, HealthService]:
    """grpcio's server on the front door's private socket, with the
    service, health (NOT_SERVING until ready) and reflection."""
    server = grpc.aio.server(
        interceptors=metrics.interceptors() if metrics else None,
        options=[
            ("grpc.max_receive_message_length", 4 * 1024 * 1024),
            ("grpc.so_reuseport", 0),
            # a connection with no call in flight is closed (GOAWAY); clients reconnect on their next call
            ("grpc.max_connection_idle_ms", int(settings.grpc_idle_timeout * 1000)),
            # the front door admits at most max_grpc_connections; the margin is for the daemon's own uid and root
            ("grpc.max_allowed_incoming_connections", settings.max_grpc_connections + 64),
        ]
    )
    add_to_server(KVCachedService(daemon, peers=front.peer), server)
    # grpc's servicer starts with "" SERVING: not ready until the devices are
    # set up and the warm pool is filled (a slow cuMemCreate takes seconds).
    health = HealthService(settings, front)  # grpcio's, with Health.Watch capped per uid (health.py)
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    old_umask = os.umask(0o077)  # grpcio's socket is private: only the front door (and root) reach it
    try:
        server.add_insecure_port(f"unix:{front.private_path}")
        await server.start()
    finally:
        os.umask(old_umask)
    return server, health


def _stop_on_signals(settings: Settings, reload) -> asyncio.Event:
    """SIGTERM and SIGINT set the event it returns; SIGHUP reloads the
    settings (its default was to die, sockets left behind)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, reload_settings, settings, reload)
    return stop


async def _prefill(daemon: Daemon, stop: asyncio.Event) -> None:
    """Fill the warm pools. Health stays NOT_SERVING meanwhile; a signal
    stops the filling after the batch in progress."""
    t0 = time.monotonic()
    filling = asyncio.ensure_future(daemon.prefill())
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((filling, stopped), return_when=asyncio.FIRST_COMPLETED)
        if not filling.done():
            log.info("stop requested while the warm pool was filling")
            for pool in daemon.pools.values():
                pool.stop_refilling()
        await filling
    finally:
        stopped.cancel()
    warm = {p.uuid: (p.n_ready_total(), p.warm_pages) for p in daemon.pools.values() if p.warm_pages}
    if warm:
        log.info("warm pool after %.2f s: %s", time.monotonic() - t0,
                 ", ".join(f"{uuid} {have}/{want} pages" for uuid, (have, want) in warm.items()))


async def _announce_ready(settings: Settings, daemon: Daemon, health: HealthService,
                          stop: asyncio.Event) -> sdnotify.Notifier:
    """Ready: health SERVING and systemd's READY=1 together (devices ready,
    warm pool filled, both sockets accepting), unless a signal came first."""
    if stop.is_set():
        return sdnotify.Notifier(None)
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    notifier = systemd.start_for(daemon)
    log.info("serving on %s (fd channel %s), pid %d", settings.socket, settings.fd_socket, os.getpid())
    return notifier


def _warn_fd_limit(daemon: Daemon, backend: Backend, nofile: int) -> None:
    pages = sum(p.budget.pages for p in daemon.pools.values())
    if backend.fds_per_page and pages * backend.fds_per_page + 256 > nofile:
        log.warning("the budget is %d pages but the open-file limit is %d: every %s page is one fd in the daemon; "
                    "raise LimitNOFILE (systemd) or ulimit -n, or use larger pages", pages, nofile, backend.kind)


async def _shut_down(daemon: Daemon, server: grpc.aio.Server, health: HealthService, channels: ChannelServer,
                     front: ControlFront, metrics: Metrics | None, notifier: sdnotify.Notifier) -> int:
    """Tell the sessions, stop accepting, release every page. 0, or 1
    when the shutdown could not release everything."""
    notifier.stopping("stopping: telling sessions")
    log.info("shutting down: telling %d sessions", len(daemon.sessions))
    await health.enter_graceful_shutdown()
    channels.stop_accepting()
    await daemon.begin_shutdown("daemon stopping (signal)")
    front.stop_accepting()
    await server.stop(grace=0.5)
    try:
        await daemon.finish_shutdown()
    except ShutdownIncomplete as exc:
        log.error("shutdown incomplete: %s", exc)
        return 1
    finally:
        front.close()
        if metrics:
            metrics.stop()
        notifier.close()
    log.info("stopped: every page released")
    return 0


def run_loop(settings: Settings, main_coro) -> int:
    """Run the daemon on the configured event loop (settings.event_loop):
    uvloop (libuv) when asked for or, with auto, when it is installed; the
    standard library's asyncio loop otherwise. grpc.aio runs on either."""
    choice = settings.event_loop
    if choice in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                main_coro.close()
                raise StartupError("--event-loop uvloop: uvloop is not installed (pip install uvloop)") from None
        else:
            log.debug("event loop: uvloop %s", uvloop.__version__)
            if hasattr(asyncio, "Runner"):  # 3.11+
                with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                    return runner.run(main_coro)
            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())  # 3.10
            return asyncio.run(main_coro)
    return asyncio.run(main_coro)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    ns = ap.parse_args(argv)
    cli = {k: v for k, v in vars(ns).items() if k in Settings.model_fields and v is not None}
    try:
        settings = load_settings(cli, ns.config)
    except ConfigError as exc:
        print(f"kvcached-serve: {exc}", file=sys.stderr)
        return 2
    if ns.print_config:
        print(json.dumps(settings.model_dump(), indent=2, sort_keys=True))
        return 0
    logging.basicConfig(
        level=settings.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until serve() handles it: a SIGHUP never kills the daemon
    try:
        return run_loop(settings, serve(settings, reload=lambda: load_settings(cli, ns.config)))
    except SettingsError as exc:
        log.error("cannot start: %s", exc)
        return 2
    except (StartupError, errors.KVCachedError) as exc:
        msg = exc.message if isinstance(exc, errors.KVCachedError) else str(exc)
        log.error("cannot start: %s", msg)
        return 1


if __name__ == "__main__":
    sys.exit(main())
