"""Several devices, on any libcuda: the test driver's KVCACHED_TESTDRV_DEVICES
there, the machine's own GPUs elsewhere (Sim.devices: skipped, naming the
count, where the driver shows fewer). Also what needs no second device:
a process that sees no device at all. (The test driver's own multi-device
model, UUID knobs and peers: test_testdriver.py, test_strictness.py.)"""

from __future__ import annotations

BACKEND_DEVICES = """
    b = open_backend()
    out(devs=[[d.uuid, d.ordinal] for d in b.devices()])
    b.close()
"""


def test_the_backend_finds_every_visible_device_in_order_by_uuid(sim):
    """CUDA_VISIBLE_DEVICES reorders ordinals, never UUIDs: the backend
    lists the devices in the order the variable gives, each with its UUID."""
    env = sim.devices(2)
    every = [u for u, _ in sim.run(BACKEND_DEVICES, **env)["devs"]]
    assert len(set(every)) == len(every) >= 2 and all(u.startswith("GPU-") for u in every), every
    r = sim.run(BACKEND_DEVICES, CUDA_VISIBLE_DEVICES="1,0", **env)
    assert r["devs"] == [[every[1], 0], [every[0], 1]]
    one = sim.run(BACKEND_DEVICES, CUDA_VISIBLE_DEVICES=every[1][:20], **env)  # a unique UUID prefix names a device
    assert one["devs"] == [[every[1], 0]]


def test_a_process_that_sees_no_device_is_refused_naming_cuinit(sim):
    """CUDA_VISIBLE_DEVICES empty: the backend refuses to start and says
    why (cuInit: no device), as kvcached-serve --backend cuda then exits
    with the reason. (Pages of device 1 mapped by a process that sees it as
    its ordinal 0: test_cuda_mapper.py's device-1 case.)"""
    r = sim.run("""
    try:
        b = open_backend(); err = None; b.close()
    except CudaUnavailable as exc:
        err = describe(exc)
    out(err=err)
""", CUDA_VISIBLE_DEVICES="")
    assert r["err"] is not None and "cuInit" in r["err"]["message"] and "CUDA_ERROR_NO_DEVICE" in r["err"]["message"], r.out


def test_daemon_with_no_visible_device_refuses_cuda_and_auto_falls_back_to_host(tmp_path):
    """kvcached-serve where the driver shows no device (CUDA_VISIBLE_DEVICES
    empty, any libcuda): `--backend cuda` exits 1 naming why, leaving no
    socket; `--backend auto` (the default) says so and serves on the host
    backend."""
    import os
    import subprocess

    from kvtest import ROOT, SERVE, testdriver_env, wait_until
    from kvcached_service.client import Client

    env = dict(os.environ, **testdriver_env(), PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    env.pop("KVCACHED_TESTDRV_REPORT", None)
    sock = str(tmp_path / "x.sock")
    proc = subprocess.run(SERVE + ["--socket", sock, "--backend", "cuda", "--memory-limit", "64MiB"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 1, proc.stderr
    assert "--backend cuda: the CUDA driver is not usable" in proc.stderr and "CUDA_ERROR_NO_DEVICE" in proc.stderr, proc.stderr
    assert not os.path.exists(sock)
    proc = subprocess.Popen(SERVE + ["--socket", sock, "--memory-limit", "64MiB", "--shutdown-grace", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert wait_until(lambda: os.path.exists(sock), timeout=30), "auto daemon did not come up"
        with Client.connect(sock) as c:
            assert c.info.backend == "host"
            with c.open_session("fallback") as s:
                s.free(s.allocate(1))
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "CUDA_ERROR_NO_DEVICE" in out, out  # the fallback names its reason
