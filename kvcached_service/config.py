"""The daemon's settings: one object, three sources.

Precedence, highest first:
  1. command-line flags (`kvcached-serve --memory-limit 8GiB`)
  2. environment variables `KVCACHED_<NAME>` (`KVCACHED_MEMORY_LIMIT=8GiB`)
  3. the TOML file given with `--config` (`memory_limit = "8GiB"`)
  4. the defaults below.
`kvcached-serve --print-config` prints the result. Invalid settings fail at
start with a message that names the setting.
"""

from __future__ import annotations

import grp
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ByteSize, Field, PrivateAttr, TypeAdapter, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

from . import backends

_BYTE_SIZE = TypeAdapter(ByteSize)
# The whole text must be a number and a unit: pydantic's ByteSize matches a
# prefix only ("1e-9" was 1 EB, its unit "e" and the rest ignored).
_SIZE_FORM = re.compile(r"(\d*\.?\d+)\s*([A-Za-z]*)", re.ASCII)
MAX_SIZE = (1 << 63) - 1  # no device or page is larger; the driver and the kernel take sizes as int64/size_t


def parse_size(text: str | int) -> int:
    """'2MiB' -> 2097152; '1.5GB' -> 1500000000; 4096 -> 4096 (pydantic's
    ByteSize: decimal units are powers of 1000, binary ones of 1024). At
    most MAX_SIZE."""
    if isinstance(text, int):
        if not 0 <= text <= MAX_SIZE:
            raise ValueError(f"size must be 0 to 2^63-1: {text}")
        return text
    t = str(text).strip()
    try:
        if not _SIZE_FORM.fullmatch(t):
            raise ValueError
        n = int(_BYTE_SIZE.validate_python(t))
    except (ValidationError, ValueError):
        raise ValueError(f"not a size: {text!r:.80} (examples: 4096, 512MiB, 8GiB, 20GB)") from None
    if n > MAX_SIZE:
        raise ValueError(f"not a size: {text!r:.80} is more than 8 EiB")
    return n


def _is_number(text: str) -> bool:
    """ASCII digits only (str.isdigit is true for "²" and other scripts'
    digits, which int() refuses or reads as numbers)."""
    return text.isascii() and text.isdigit() and len(text) <= 20


def format_size(n: int) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}".replace(".00 ", " ")
    return f"{n} B"


@dataclass(frozen=True)
class MemoryLimit:
    """`--memory-limit`, parsed once: a byte count, or a percentage of each
    device's memory. `resolve(total)` gives one device's budget in bytes; a
    percentage needs a device to mean anything, so nothing is resolved
    before the devices are known."""

    text: str
    nbytes: int | None = None
    percent: float | None = None

    @classmethod
    def parse(cls, text: str) -> "MemoryLimit":
        t = str(text).strip()
        if t.endswith("%"):
            try:
                pct = float(t[:-1])
            except ValueError:
                raise ValueError(f"not a percentage: {text!r} (examples: 90%, 50%)") from None
            if not 0 < pct <= 100:
                raise ValueError(f"percentage must be in (0, 100]: {text!r}")
            return cls(t, percent=pct)
        n = parse_size(t)
        if n <= 0:
            raise ValueError(f"must be positive: {text!r}")
        return cls(t, nbytes=n)

    def resolve(self, device_total: int) -> int:
        """This limit's budget on a device of `device_total` bytes."""
        if self.percent is not None:
            return int(device_total * self.percent / 100)
        assert self.nbytes is not None
        return self.nbytes

    def __str__(self) -> str:
        return self.text


class Settings(BaseSettings):
    """Every setting of kvcached-serve. Field docs are the --help text."""

    model_config = SettingsConfigDict(env_prefix="KVCACHED_", extra="forbid", validate_default=True)
    _toml_file: ClassVar[Path | None] = None
    _memory_limit: MemoryLimit = PrivateAttr()

    socket: str = Field("/tmp/kvcached.sock", description="gRPC control socket path")
    fd_socket: str = Field("", description="fd channel socket path (default: <socket>.fd)")
    backend: str = Field("auto", description=backends.auto_help())
    memory_limit: str = Field("90%", description="budget per device: bytes with units (8GiB) or a percentage of device memory")
    page_size: str = Field("2MiB", description="bytes per page; a multiple of the backend granularity")
    prealloc: str = Field("0", description="warm pages created ahead of demand per device, as a size (256MiB)")
    pool_idle_seconds: float = Field(30.0, ge=0, description="pooled pages beyond the warm target idle this long go back to the device")
    zero_pages: bool = Field(True, description="zero pages before they change session (see docs/architecture.md)")
    kept_exports: int = Field(-1, ge=-1, description="CUDA: pages per device that keep their exported fd for their life, so a loan makes no driver call (-1: the open-file limit less a quarter of it; 0: export on every delivery; docs/architecture.md, File descriptors)")
    socket_mode: str = Field("0660", description="permission bits of both socket files (octal)")
    socket_group: str = Field("", description="group owning the socket files (name or gid); empty = the daemon's")
    allowed_uids: Annotated[list[int], NoDecode] = Field(default_factory=list, description="uids allowed to open sessions (comma-separated); empty = anyone who can open the socket")
    admin_uids: Annotated[list[int], NoDecode] = Field(default_factory=lambda: [0], description="uids whose sessions may use admin rpcs; the daemon's own uid always may")
    max_pages_per_request: int = Field(65536, ge=1, le=1 << 24, description="largest Allocate, in pages")
    max_sessions: int = Field(4096, ge=1, description="open sessions in total")
    max_sessions_per_uid: int = Field(1024, ge=1, description="open sessions (and unbound fd channels) per uid")
    grpc_page_ops: bool = Field(False, description="also serve Allocate/Free/CloseSession over gRPC, where a SessionRef is a bearer secret (for tools such as grpcurl); off: only as requests on the session's own fd channel, whose sender the kernel names (docs/architecture.md, Security model)")
    channel_ops_only: bool | None = Field(None, description="page operations only on the fd channel: the default, kept for command lines that say so; --no-channel-ops-only is --grpc-page-ops")
    max_grpc_connections: int = Field(1024, ge=1, description="control-socket (gRPC) connections open at once, all uids together")
    max_grpc_connections_per_uid: int = Field(256, ge=1, description="control-socket (gRPC) connections open at once per uid (SO_PEERCRED); keep it below max_grpc_connections")
    max_health_watches_per_uid: int = Field(16, ge=0, description="Health.Watch streams open at once per uid that is not an admin (a Watch keeps its connection from idling out); Health.Check is never limited")
    grpc_admin_reserve: int = Field(64, ge=0, description="control-socket connections of max_grpc_connections that only admin uids and the daemon's own uid may use, so other uids filling every slot they can never lock out operators or the health probe")
    grpc_idle_timeout: float = Field(120.0, gt=0, description="seconds a control connection with no call in flight stays open (clients reconnect on their next call)")
    fd_send_timeout: float = Field(5.0, gt=0, description="seconds a client may leave its fd channel full before its session is ended")
    channel_bind_timeout: float = Field(30.0, gt=0, description="seconds an fd channel may stay without a session")
    host_memory: str = Field("", description="device size the host backend reports (default: physical RAM)")
    default_wait_ms: int = Field(10000, ge=0, description="default wait of an Allocate with wait=true, in ms")
    reclaim_timeout_ms: int = Field(2000, ge=1, description="time a session gets to answer a reclaim request, in ms")
    memory_poll_seconds: float = Field(1.0, ge=0, description="how often the daemon reads each device's free memory (cuMemGetInfo; host: MemAvailable) to cap its budget at what the device has; 0 = at start and when an Allocate finds the budget short")
    idle_shrink_seconds: float = Field(0.0, ge=0, description="ask sessions idle this long to shrink to their guarantee; 0 = never")
    shutdown_grace: float = Field(2.0, ge=0, description="seconds between telling sessions about shutdown and closing them")
    metrics_address: str = Field("", description="host:port for Prometheus metrics; empty = off")
    state_dir: str = Field("", description="directory for the daemon's journal, which lets clients resume their sessions after a crash; empty = none")
    page_store: Literal["auto", "systemd", "keeper", "none"] = Field("auto", description="with --state-dir: keep the daemon's own fd of every lent page where it outlives the daemon, so a restart resumes sessions from those fds whatever the driver's fds look like (docs/cuda.md, Page identity): systemd = the unit's fd store (FileDescriptorStoreMax=), keeper = a keeper process, auto = systemd when the unit has a store ($FDSTORE), else keeper; none = resume by the fds clients re-send")
    resume_grace: float = Field(60.0, gt=0, description="seconds a restarted daemon keeps a journaled session's pages for its client to resume it")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="log level")
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field("auto", description="the daemon's event loop: uvloop (faster request path), asyncio (the standard library's), auto = uvloop when installed")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if cls._toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=cls._toml_file))
        return tuple(sources)

    @field_validator("allowed_uids", "admin_uids", mode="before")
    @classmethod
    def _uid_list(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [int(x) for x in v.replace(" ", "").split(",") if x]
        return v

    @field_validator("backend")
    @classmethod
    def _backend(cls, v: str) -> str:
        """One of the registry's backends or auto (backends/__init__.py),
        in pydantic's words for a Literal."""
        if v not in backends.choices():
            raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": backends.quoted_choices()})
        return v

    @field_validator("page_size", "prealloc")
    @classmethod
    def _size(cls, v: str) -> str:
        parse_size(v)
        return v

    @field_validator("host_memory")
    @classmethod
    def _opt_size(cls, v: str) -> str:
        if v:
            parse_size(v)
        return v

    @field_validator("memory_limit")
    @classmethod
    def _limit(cls, v: str) -> str:
        MemoryLimit.parse(v)
        return v

    @field_validator("socket_mode")
    @classmethod
    def _mode(cls, v: str) -> str:
        mode = int(str(v), 8)
        if mode & ~0o777:
            raise ValueError(f"not a permission mode: {v!r}")
        return v

    @field_validator("socket_group")
    @classmethod
    def _group(cls, v: str) -> str:
        if v and _is_number(v):
            if int(v) >= 1 << 32:
                raise ValueError(f"not a gid (0 to 2^32-1): {v!r:.40}")
        elif v:
            try:
                grp.getgrnam(v)
            except KeyError:
                raise ValueError(f"no such group: {v!r:.80}") from None
        return v

    @field_validator("metrics_address")
    @classmethod
    def _address(cls, v: str) -> str:
        if v:
            host, sep, port = v.rpartition(":")
            if not sep or not _is_number(port) or not 0 <= int(port) <= 65535:
                raise ValueError(f"expected host:port, got {v!r}")
        return v

    @model_validator(mode="after")
    def _paths(self) -> "Settings":
        if not self.socket:
            raise ValueError("socket: must not be empty")
        if not self.fd_socket:
            self.fd_socket = self.socket + ".fd"
        if self.fd_socket == self.socket:
            raise ValueError("fd_socket: must differ from socket")
        if parse_size(self.page_size) == 0:
            raise ValueError("page_size: must be positive")
        if self.channel_ops_only is not None:
            if self.channel_ops_only and self.grpc_page_ops:
                raise ValueError("channel_ops_only and grpc_page_ops contradict each other (channel_ops_only is the default now: drop it)")
            if not self.channel_ops_only:
                self.grpc_page_ops = True
        if self.grpc_admin_reserve >= self.max_grpc_connections:
            raise ValueError(f"grpc_admin_reserve ({self.grpc_admin_reserve}) must be below max_grpc_connections "
                             f"({self.max_grpc_connections}): other uids would have no control connection at all")
        self._memory_limit = MemoryLimit.parse(self.memory_limit)
        return self

    # ---- derived values -------------------------------------------------
    @property
    def memory_limit_value(self) -> MemoryLimit:
        """memory_limit as parsed at validation (resolve it per device)."""
        return self._memory_limit

    @property
    def page_size_bytes(self) -> int:
        return parse_size(self.page_size)

    @property
    def prealloc_bytes(self) -> int:
        return parse_size(self.prealloc)

    @property
    def socket_mode_bits(self) -> int:
        return int(self.socket_mode, 8)

    @property
    def socket_gid(self) -> int | None:
        if not self.socket_group:
            return None
        if _is_number(self.socket_group):
            return int(self.socket_group)
        return grp.getgrnam(self.socket_group).gr_gid

    @property
    def page_ops_on_channel_only(self) -> bool:
        """Allocate/Free/CloseSession only as fd channel requests (the
        default), not over gRPC (--grpc-page-ops)."""
        return not self.grpc_page_ops

    def is_admin(self, uid: int) -> bool:
        return uid in self.admin_uids or uid == os.getuid()


class ConfigError(Exception):
    """Invalid settings; the message names each bad setting."""


def load_settings(cli: dict[str, Any], config_file: str | None = None) -> Settings:
    """Build Settings from CLI values (only those given), the environment and
    an optional TOML file."""
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"config file not found: {config_file}")
    try:
        Settings._toml_file = Path(config_file) if config_file else None
        return Settings(**cli)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            name = ".".join(str(p) for p in err["loc"]) or "settings"
            env = f"KVCACHED_{name.upper()}"
            lines.append(f"  {name} (--{name.replace('_', '-')}, {env}): {err['msg']}")
        raise ConfigError("invalid settings:\n" + "\n".join(lines)) from None
    except Exception as exc:  # a TOML syntax error, for one
        raise ConfigError(f"invalid settings: {exc}") from None
    finally:
        Settings._toml_file = None
