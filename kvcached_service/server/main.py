"""kvcached-serve: the command line, backend choice, and the server's life.

Exit codes: 0 after a clean shutdown (SIGTERM/SIGINT), 2 for invalid
settings, 1 when the daemon cannot start (backend unusable, socket busy).
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

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .. import __version__, errors
from .._generated.kvcached.v1 import kvcached_pb2 as pb
from ..backends.base import Backend
from ..config import ConfigError, Settings, load_settings, parse_size
from . import sdnotify
from .channel import ChannelServer
from .daemon import Daemon, ShutdownIncomplete
from .metrics import Metrics
from .service import KVCachedService, add_to_server
from .sockets import apply_socket_permissions, prepare_socket_path

log = logging.getLogger("kvcached")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVCached"].full_name


class StartupError(Exception):
    pass


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
        if field.annotation is bool:
            ap.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            ap.add_argument(flag, dest=name, default=None, metavar=name.upper(), help=help_text)
    return ap


def open_backend(settings: Settings) -> Backend:
    """The backend named by settings.backend; auto = cuda when usable."""
    from ..backends.host import HostBackend

    host_total = parse_size(settings.host_memory) if settings.host_memory else None
    if settings.backend == "host":
        log.info("backend: host (memfd pages), as configured")
        return HostBackend(host_total)
    try:
        from ..backends import cuda as cuda_backend

        backend = cuda_backend.open_backend()
    except Exception as exc:  # noqa: BLE001 - any reason the driver is unusable
        reason = f"{type(exc).__name__}: {exc}" if not isinstance(exc, errors.KVCachedError) else exc.message
        if settings.backend == "cuda":
            raise StartupError(f"--backend cuda: the CUDA driver is not usable: {reason}") from None
        log.warning("backend: host (memfd pages): no usable CUDA driver (%s); serving host memory instead of GPU memory", reason)
        return HostBackend(host_total)
    log.info("backend: cuda (driver VMM API), %d device(s)", len(backend.devices()))
    return backend


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


async def serve(settings: Settings, ready_hook=None) -> int:
    nofile = raise_fd_limit()
    backend = open_backend(settings)
    daemon = Daemon(settings, backend)
    channels = ChannelServer(daemon, settings)  # the fd channel adapter, beside the gRPC one
    try:
        daemon.start_devices()
        daemon.recover()
    except errors.KVCachedError as exc:
        backend.close()
        raise StartupError(exc.message) from None
    except (OSError, ValueError) as exc:  # an unreadable or corrupt journal
        backend.close()
        raise StartupError(f"state directory {settings.state_dir}: {exc}") from None

    prepare_socket_path(settings.socket)
    metrics = Metrics(daemon) if settings.metrics_address else None
    server = grpc.aio.server(
        interceptors=metrics.interceptors() if metrics else None,
        options=[
            ("grpc.max_receive_message_length", 4 * 1024 * 1024),
            ("grpc.so_reuseport", 0),
        ]
    )
    add_to_server(KVCachedService(daemon), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    old_umask = os.umask(0o177)  # the socket file is born private; then chmod to the configured mode
    try:
        server.add_insecure_port(f"unix:{settings.socket}")
        await server.start()
    finally:
        os.umask(old_umask)
    apply_socket_permissions(settings.socket, settings)
    try:
        channels.start()
        await daemon.prefill()
        if metrics:
            metrics.start_http(settings.metrics_address)
    except Exception:
        await server.stop(None)
        _unlink(settings.socket)
        raise
    daemon.start_background()

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving on %s (fd channel %s), pid %d", settings.socket, settings.fd_socket, os.getpid())
    pages = sum(p.budget.pages for p in daemon.pools.values())
    if backend.fds_per_page and pages * backend.fds_per_page + 256 > nofile:
        log.warning("the budget is %d pages but the open-file limit is %d: every %s page is one fd in the daemon; "
                    "raise LimitNOFILE (systemd) or ulimit -n, or use larger pages", pages, nofile, backend.kind)
    if ready_hook is not None:
        ready_hook(daemon)
    notifier = sdnotify.start_for(daemon)
    await stop.wait()
    notifier.stopping("stopping: telling sessions")

    log.info("shutting down: telling %d sessions", len(daemon.sessions))
    await health_servicer.enter_graceful_shutdown()
    channels.stop_accepting()
    await daemon.begin_shutdown("daemon stopping (signal)")
    await server.stop(grace=0.5)
    try:
        await daemon.finish_shutdown()
    except ShutdownIncomplete as exc:
        log.error("shutdown incomplete: %s", exc)
        return 1
    finally:
        _unlink(settings.socket)
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


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


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
    try:
        return run_loop(settings, serve(settings))
    except (StartupError, errors.KVCachedError) as exc:
        msg = exc.message if isinstance(exc, errors.KVCachedError) else str(exc)
        log.error("cannot start: %s", msg)
        return 1


if __name__ == "__main__":
    sys.exit(main())
