"""The fuzz targets' committed corpora, replayed without a fuzzing engine
(tests/fuzz/targets.py; docs/fuzzing.md), and the findings of the fuzz runs
as regression tests. Every input must pass its target: no exception but the
decoder's documented errors, every contract check holding."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fuzz"))
import targets  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def c_decoder(tmp_path_factory):
    """The C client's decoder as a library, for the fdchannel target's
    differential check (tests/fuzz/c/classify.c), where gcc is."""
    so = tmp_path_factory.mktemp("fuzz") / "libkvcfd.so"
    root = targets.ROOT
    built = subprocess.run(["gcc", "-O1", "-shared", "-fPIC", f"-I{root}/clients/c/include", f"-I{root}/clients/c/src",
                            f"{root}/tests/fuzz/c/classify.c", f"{root}/clients/c/src/fdchannel.c", "-o", str(so)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    saved, targets._CLIB, targets._clib = targets._CLIB, so, None
    yield
    targets._CLIB, targets._clib = saved, None


@pytest.mark.parametrize("target", targets.TARGETS)
def test_corpus_and_seeds_pass(target):
    fn = getattr(targets, target)
    inputs = [p.read_bytes() for p in sorted((targets.CORPUS / target).glob("*"))] + targets.seeds(target)
    assert len(inputs) >= 5
    for data in inputs:
        fn(data)


def test_fd_channel_corpora_pass_the_python_decoder():
    """The C and Go targets' corpora are in the same format: the Python
    decoder must hold on them too, and answer as the C decoder does."""
    assert targets._CLIB.exists()
    for name in ("c_fdchannel", "go_fdchannel"):
        for p in sorted((targets.CORPUS / name).glob("*")):
            targets.fdchannel(p.read_bytes())


def test_python_and_c_decoders_agree_on_the_longest_drop():
    """A DROP of 520 ids (the spec's max_drop_ids is 519): Python and C both
    refuse it as a protocol error (C took up to 16,384 before 364ec9c, the
    one difference the differential check allowed; it allows none now)."""
    import struct

    from kvcached_service import fdchannel as fc

    targets.fdchannel(b"\0\0" + fc._frame(fc.DROP, struct.pack("<II", 520, 0) + b"\1" * 8 * 520))


def test_store_names_in_other_scripts_digits_are_not_a_format():
    """Found by inspection while writing the keeper_names target: "~²3.x"
    made store_format_of call int("²3") (str.isdigit is true for it): a
    ValueError out of SystemdStore.take_all, so a daemon given that fd name
    by systemd failed to start."""
    from kvcached_service.server.recovery.keeper import store_format_of

    assert store_format_of("~²3.x") is None
    assert store_format_of("~٣.x") is None  # int() would read it as 3
    assert store_format_of("~3.x") == 3
    targets.keeper_names(b"\x02~\xc2\xb23.x:~1")


def test_store_names_longer_than_any_page_are_not_pages():
    """page_of read a name of any length as a number: one 128 KiB name (as
    much as LISTEN_FDNAMES holds) cost 4 s of big-integer arithmetic and
    gave an id far beyond 2^64."""
    from kvcached_service.server.recovery.keeper import fdname, page_of

    t0 = time.monotonic()
    assert page_of("~" + "_" * (128 << 10)) is None
    assert time.monotonic() - t0 < 0.1
    assert page_of(fdname((1 << 64) - 1)) == (1 << 64) - 1
    assert page_of("~" + "_" * 11) is None  # 2^66 - 1
    assert page_of("~0") == 0


def test_listen_fds_bounds_its_count_and_unsets_on_a_bad_one():
    """LISTEN_FDS=99999999999 made listen_fds try 10^11 descriptors (a
    hang at start); a LISTEN_FDS that is not a number left the LISTEN_*
    variables for children (sd_listen_fds unsets them on that failure too)."""
    from kvcached_service.server.recovery.keeper import listen_fds

    t0 = time.monotonic()
    env = {"LISTEN_PID": "9", "LISTEN_FDS": "99999999999", "LISTEN_FDNAMES": "~1"}
    listen_fds(env, pid=9)
    assert time.monotonic() - t0 < 5 and env == {}
    env = {"LISTEN_PID": "9", "LISTEN_FDS": "x", "LISTEN_FDNAMES": "~1"}
    assert listen_fds(env, pid=9) == [] and env == {}


def test_keeper_survives_records_it_cannot_read():
    """Found by the keeper_records target: a record of 64 KiB of "[" raised
    RecursionError out of the keeper's _recv and {"op": "drop", "ids": [[1]]}
    a TypeError out of its handling; either ended the keeper process, and
    with it every page fd it held. Now both are refused and the store kept.
    A TAKE that came with descriptors leaked them."""
    import os
    import socket

    from kvcached_service.server.recovery import keeper as kp

    with pytest.raises(ValueError):
        kp.decode(b"[" * 65000, [])
    k = kp.Keeper.__new__(kp.Keeper)
    fd = os.open(os.devnull, os.O_RDONLY)
    k.store = {1: fd}
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        for msg in ({"op": "drop", "ids": [[1]]}, {"op": "put", "ids": 5}, {"op": "drop", "ids": [True]}):
            k.handle(a, msg, [])
            assert k.store == {1: fd}
        extra = os.open(os.devnull, os.O_RDONLY)
        k.handle(a, {"op": "take"}, [extra])
        with pytest.raises(OSError):
            os.fstat(extra)
    finally:
        kp.close_fds(k.store.values())
        a.close()
        b.close()


def test_daemon_refuses_a_take_answer_that_is_not_pages():
    """The daemon's side (take_reply): "ids" that are not a list raised a
    TypeError out of PageStore.take_all (a failed start); ids and fds of
    different counts leaked the extra fds (zip). Now ValueError, fds closed."""
    import os

    from kvcached_service.server.recovery import keeper as kp

    for msg, n in (({"op": "pages", "ids": 5}, 1), ({"op": "pages", "ids": [1]}, 2), ({"op": "pages", "ids": [1, 1]}, 2)):
        fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(n)]
        with pytest.raises(ValueError):
            kp.take_reply(msg, fds, {})
        for fd in fds:
            with pytest.raises(OSError):
                os.fstat(fd)
    with pytest.raises(kp.StoreTooNew):
        kp.take_reply({"op": "pages", "format": 2, "ids": []}, [], {})


def test_config_sizes_are_whole_and_bounded():
    """Found writing the config target: pydantic's ByteSize reads a prefix,
    so memory_limit "1e-9" was 1 EB (unit "e", the rest ignored) and
    "8GiB-x" 8 GiB; a size of 10^56 bytes was taken. Now the whole text must
    be a number and a unit, at most 2^63-1 bytes."""
    from kvcached_service.config import ConfigError, load_settings, parse_size

    for bad in ("1e-9", "8GiB-x", "99999999999999999999999999999999999999 EiB", "8EiB"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(bad)
    assert parse_size(" 8 GiB ") == 8 << 30 and parse_size(".5KiB") == 512 and parse_size("7EiB") == 7 << 60
    with pytest.raises(ConfigError, match="memory_limit.*not a size"):
        load_settings({"memory_limit": "1e-9"})


def test_socket_group_and_metrics_port_are_ascii_numbers():
    """socket_group "²" passed validation (str.isdigit) and then raised
    ValueError from int() when the daemon read socket_gid at start; a gid of
    2^32 or more would fail in chown. metrics_address ":²" got int()'s own
    message. Now each is refused naming the setting."""
    from kvcached_service.config import ConfigError, load_settings

    for kw, what in (({"socket_group": "²"}, "socket_group"), ({"socket_group": "4294967296"}, "not a gid"),
                     ({"metrics_address": "localhost:²"}, "expected host:port")):
        with pytest.raises(ConfigError, match=what):
            load_settings(kw)
    assert load_settings({"socket_group": "0"}).socket_gid == 0
