"""deploy/: Prometheus rules (promtool check + unit tests), scrape configs,
the Grafana dashboard against the daemon's real metric names, the systemd
units (systemd-analyze verify) and the daemon's sd_notify messages, the
Dockerfile and the Kubernetes manifests (structure only: no Docker engine
or cluster here, see docs/operations.md).

Needs Debian's `prometheus` (promtool) and `systemd` (systemd-analyze):
scripts/setup-ops.sh installs them."""

from __future__ import annotations

import configparser
import json
import os
import pathlib
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time

import pytest
import yaml

from kvcached_service.server.ops.main import build_parser
from kvcached_service.server.ops.metrics import Metrics, Nvml
from test_metrics import FakeNvml, fake_daemon, names_in_exposition, scrape, start_with_metrics, tool

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
PROM = DEPLOY / "prometheus"
SYSTEMD = DEPLOY / "systemd"
K8S = DEPLOY / "k8s"


def run(cmd: list[str], cwd: pathlib.Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


# ---- Prometheus ---------------------------------------------------------------
def test_alert_rules_check_and_unit_tests():
    r = run([tool("promtool"), "check", "rules", str(PROM / "kvcached-rules.yml")])
    assert r.returncode == 0, r.stdout + r.stderr
    r = run([tool("promtool"), "test", "rules", "kvcached-rules.test.yml"], cwd=PROM)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    alerts = {rule["alert"] for g in yaml.safe_load((PROM / "kvcached-rules.yml").read_text())["groups"] for rule in g["rules"]}
    assert {"KvcachedDown", "KvcachedPoolExhausted", "KvcachedReclaimIgnored", "KvcachedAllocateLatencyHigh"} <= alerts
    tested = {t["alertname"] for case in yaml.safe_load((PROM / "kvcached-rules.test.yml").read_text())["tests"] for t in case["alert_rule_test"]}
    assert alerts == tested, f"alerts without a unit test: {alerts - tested}"


@pytest.mark.parametrize("mutation", [
    # the old rule: a fill threshold of 98 % misses exhaustion at 94 %
    ("/ sum by (instance, device) (kvcached_device_budget_bytes)\n",
     "/ sum by (instance, device) (kvcached_device_budget_bytes) >= 0.98\n"),
    # no failure condition: a full pool that serves every request would alert
    ("and on (instance, device)\n          (sum by (instance, device) (increase(kvcached_device_allocation_failures_total[5m])) > 0)",
     "or on (instance, device) vector(0)"),
])
def test_rule_unit_tests_fail_when_a_rule_changes(tmp_path, mutation):
    """The unit tests bite: the pool rule changed back or loosened fails them."""
    rules = (PROM / "kvcached-rules.yml").read_text()
    old, new = mutation
    assert old in rules
    (tmp_path / "kvcached-rules.yml").write_text(rules.replace(old, new))
    shutil.copy(PROM / "kvcached-rules.test.yml", tmp_path)
    r = run([tool("promtool"), "test", "rules", "kvcached-rules.test.yml"], cwd=tmp_path)
    assert r.returncode != 0 and "KvcachedPoolExhausted" in r.stdout + r.stderr, r.stdout + r.stderr


def test_scrape_configs():
    r = run([tool("promtool"), "check", "config", str(PROM / "prometheus.yml")])
    assert r.returncode == 0, r.stdout + r.stderr
    # Debian's promtool is built without Kubernetes discovery, so the
    # in-cluster config is checked for structure only.
    k = yaml.safe_load((PROM / "prometheus-kubernetes.yml").read_text())
    job = k["scrape_configs"][0]
    assert job["job_name"] == "kvcached" and job["kubernetes_sd_configs"] == [{"role": "pod"}]
    keeps = {tuple(rc["source_labels"]): rc.get("regex") for rc in job["relabel_configs"] if rc.get("action") == "keep"}
    assert keeps[("__meta_kubernetes_pod_annotation_prometheus_io_scrape",)] == "true"
    assert k["rule_files"] == ["kvcached-rules.yml"]


def kubernetes_sd_results(tmp_path: pathlib.Path, targets: list[dict]) -> list[dict]:
    """The in-cluster job's relabeling, run by promtool itself: the job from
    prometheus-kubernetes.yml with its kubernetes_sd_configs replaced by a
    file_sd_configs holding the targets Kubernetes discovery would produce
    (Debian's promtool has no Kubernetes discovery). Nothing is scraped."""
    k = yaml.safe_load((PROM / "prometheus-kubernetes.yml").read_text())
    job = k["scrape_configs"][0]
    assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
    job["file_sd_configs"] = [{"files": [str(tmp_path / "targets.json")]}]
    k.pop("rule_files")
    (tmp_path / "targets.json").write_text(json.dumps(targets))
    (tmp_path / "p.yml").write_text(yaml.safe_dump(k))
    r = run([tool("promtool"), "check", "service-discovery", str(tmp_path / "p.yml"), "kvcached", "--timeout=10s"])
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def pod_target(address: str, ip: str, pod: str, *, init: bool = False, app: str = "kvcached", scrape: str = "true") -> dict:
    """A target as Prometheus' Kubernetes pod discovery makes it: one per
    declared container port, a port-less one per container without ports
    (init containers included)."""
    return {"targets": [address], "labels": {
        "__meta_kubernetes_pod_ip": ip,
        "__meta_kubernetes_pod_name": pod,
        "__meta_kubernetes_namespace": "kvcached",
        "__meta_kubernetes_pod_node_name": "node-" + pod,
        "__meta_kubernetes_pod_container_init": "true" if init else "false",
        "__meta_kubernetes_pod_label_app_kubernetes_io_name": app,
        "__meta_kubernetes_pod_annotation_prometheus_io_scrape": scrape,
        "__meta_kubernetes_pod_annotation_prometheus_io_port": "9461",
        "__meta_kubernetes_pod_annotation_prometheus_io_path": "/metrics",
    }}


def test_kubernetes_relabeling_ipv4_ipv6_and_init_containers(tmp_path):
    got = kubernetes_sd_results(tmp_path, [
        pod_target("10.1.2.3:8080", "10.1.2.3", "v4"),          # another declared port: the annotation's wins
        pod_target("[fd00::5]:8080", "fd00::5", "v6"),          # IPv6 with a port
        pod_target("2001:db8::7", "2001:db8::7", "v6-noport"),  # IPv6 from a container without ports
        pod_target("fd00::5", "fd00::5", "v6", init=True),       # the init container: dropped
        pod_target("10.9.9.9:9461", "10.9.9.9", "other", app="something-else"),
        pod_target("10.9.9.8:9461", "10.9.9.8", "off", scrape="false"),
    ])
    kept = {t["labels"]["pod"]: t["labels"] for t in got if t["labels"]}
    assert set(kept) == {"v4", "v6", "v6-noport"}, got
    assert kept["v4"]["__address__"] == "10.1.2.3:9461"
    assert kept["v6"]["__address__"] == "[fd00::5]:9461"
    assert kept["v6-noport"]["__address__"] == "[2001:db8::7]:9461"
    assert kept["v6"]["__metrics_path__"] == "/metrics" and kept["v6"]["node"] == "node-v6"
    assert kept["v4"]["namespace"] == "kvcached"
    assert sum(1 for t in got if not t["labels"]) == 3  # init container, other app, scrape off


def metric_names_used(exprs: list[str]) -> set[str]:
    names = set()
    for e in exprs:
        e = re.sub(r'"[^"]*"', '""', e)  # not inside label values
        names.update(re.findall(r"\b((?:kvcached|process)_[a-z0-9_]+)", e))
    return names


def all_exported_names(daemon_factory) -> set[str]:
    """What a live daemon exports (with activity), plus the NVML series a
    fake NVML produces (no GPU here)."""
    d = start_with_metrics(daemon_factory)
    with d.client() as c, c.open_session("m") as s:
        s.allocate(1)
        text = scrape(d)
    gpu = Metrics(fake_daemon(), nvml=Nvml(loader=FakeNvml), process=False).text().decode()
    return names_in_exposition(text) | names_in_exposition(gpu)


def test_dashboard_and_rules_only_use_metrics_the_daemon_exports(daemon_factory):
    dash = json.loads((DEPLOY / "grafana" / "kvcached-dashboard.json").read_text())
    exprs = []
    for p in dash["panels"]:
        exprs += [t["expr"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    used = metric_names_used(exprs)
    assert len(used) >= 20, used
    rules = yaml.safe_load((PROM / "kvcached-rules.yml").read_text())
    rule_names = metric_names_used([r["expr"] for g in rules["groups"] for r in g["rules"]])
    exported = all_exported_names(daemon_factory)
    assert not used - exported, f"the dashboard queries metrics the daemon does not export: {sorted(used - exported)}"
    assert not rule_names - exported, f"alert rules use metrics the daemon does not export: {sorted(rule_names - exported)}"
    # panel ids unique, every panel has a datasource and a position
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert all("gridPos" in p for p in dash["panels"])
    assert dash["uid"] == "kvcached"


def test_metric_name_check_catches_a_typo():
    assert metric_names_used(['sum(kvcached_device_in_use_byte{device="kvcached_x"})']) == {"kvcached_device_in_use_byte"}


# ---- systemd -----------------------------------------------------------------
def unit(path: pathlib.Path) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    cp.optionxform = str  # keep key case

    # repeated keys (DeviceAllow=...) collapse in configparser: read them by hand too
    cp.read_string(path.read_text())
    return cp


def values(path: pathlib.Path, key: str) -> list[str]:
    return [l.split("=", 1)[1].strip() for l in path.read_text().splitlines() if l.startswith(key + "=")]


def verify_root(tmp_path: pathlib.Path) -> pathlib.Path:
    """A throw-away root for systemd-analyze verify: the distribution's units
    (sysinit.target, ...), ours, stub binaries at ExecStart's paths."""
    root = tmp_path / "root"
    (root / "usr/lib/systemd").mkdir(parents=True)
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    etc = root / "etc/systemd/system"
    (etc / "ollama.service.d").mkdir(parents=True)
    shutil.copy(SYSTEMD / "kvcached.service", etc)
    shutil.copy(SYSTEMD / "ollama.service.d" / "kvcached.conf", etc / "ollama.service.d")
    # Ollama's own unit, as its install script writes it
    (etc / "ollama.service").write_text(
        "[Unit]\nDescription=Ollama Service\nAfter=network-online.target\n\n"
        "[Service]\nExecStart=/usr/local/bin/ollama serve\nUser=ollama\nGroup=ollama\nRestart=always\nRestartSec=3\n\n"
        "[Install]\nWantedBy=default.target\n"
    )
    (root / "usr/local/bin").mkdir(parents=True)
    (root / "bin").mkdir()
    for exe in ("usr/local/bin/kvcached-serve", "usr/local/bin/ollama", "bin/kill"):  # kill: ExecReload
        p = root / exe
        p.write_text("#!/bin/sh\nexit 0\n")
        p.chmod(0o755)
    return root


def verify(root: pathlib.Path, *units: str) -> subprocess.CompletedProcess:
    return run([tool("systemd-analyze"), "verify", f"--root={root}", "--man=no",
                *(str(root / "etc/systemd/system" / u) for u in units)])


def test_systemd_units_verify(tmp_path):
    root = verify_root(tmp_path)
    r = verify(root, "kvcached.service", "ollama.service")
    # verify exits 0 on unknown keys too (it only warns): any output is a failure
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr
    # systemctl reload: SIGHUP re-reads the settings (tests/test_daemon.py::test_sighup_reloads_what_it_can_and_never_kills)
    assert values(SYSTEMD / "kvcached.service", "ExecReload") == ["/bin/kill -HUP $MAINPID"]


def test_systemd_verify_catches_a_bad_unit(tmp_path):
    root = verify_root(tmp_path)
    u = root / "etc/systemd/system/kvcached.service"
    u.write_text(u.read_text().replace("WatchdogSec=", "WatchdogSecs="))
    r = verify(root, "kvcached.service")
    assert "WatchdogSecs" in r.stdout + r.stderr


def test_kvcached_unit_settings():
    path = SYSTEMD / "kvcached.service"
    u = unit(path)
    s = u["Service"]
    assert s["Type"] == "notify" and s["NotifyAccess"] == "main"
    assert int(s["WatchdogSec"]) > 0
    assert s["RuntimeDirectory"] == "kvcached" and s["RuntimeDirectoryMode"] == "0750"
    assert s["LimitNOFILE"] == "1048576"
    assert s["PrivateDevices"] == "no" and s["PrivateTmp"] == "yes"
    assert s["Restart"] in ("on-failure", "always")
    # GPU or nothing, retried until the driver is there; bad settings are not retried
    assert u["Unit"]["StartLimitIntervalSec"] == "0"
    assert s["RestartPreventExitStatus"] == "2"
    env = dict(v.split("=", 1) for v in values(path, "Environment"))
    assert env["KVCACHED_BACKEND"] == "cuda" and env["PROMETHEUS_DISABLE_CREATED_SERIES"] == "true"
    # the page store in systemd's fd store, big enough for 512 GiB of 2 MiB pages (tests/test_systemd_store.py)
    assert env["KVCACHED_PAGE_STORE"] == "systemd" and int(s["FileDescriptorStoreMax"]) >= 262144
    assert unit_settings({"KVCACHED_PAGE_STORE": env["KVCACHED_PAGE_STORE"]}, [])["page_store"] == "systemd"
    # systemd 254+: the drop-in keeps the store across `systemctl restart` (systemd-analyze here is older
    # and would call the key unknown, so it is read, not verified)
    drop = unit(SYSTEMD / "kvcached.service.d" / "fdstore-preserve.conf")
    assert drop["Service"]["FileDescriptorStorePreserve"] == "restart"
    text = path.read_text()
    # EnvironmentFile= overrides Environment= in systemd whatever the order; keep the file last for readers
    assert text.index("EnvironmentFile=-/etc/default/kvcached") > text.index("Environment=KVCACHED_BACKEND=cuda")
    allow = values(path, "DeviceAllow")
    assert "char-nvidia* rw" in allow and "/dev/nvidiactl rw" in allow and "/dev/nvidia-uvm rw" in allow
    assert "MemoryDenyWriteExecute=yes" not in path.read_text()
    # ExecStart's flags are ones kvcached-serve accepts, socket under /run/kvcached
    argv = shlex.split(s["ExecStart"].replace("\\\n", " "))
    assert argv[0] == "/usr/local/bin/kvcached-serve"
    ns = build_parser().parse_args(argv[1:])
    assert ns.socket == "/run/kvcached/kvcached.sock"
    assert ns.socket_group == "ollama" and ns.socket_mode == "0660"
    assert ns.metrics_address.startswith("127.0.0.1:")


def unit_settings(env: dict[str, str], argv: list[str]) -> dict:
    """What kvcached-serve resolves from this environment and these flags."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    r = subprocess.run([sys.executable, "-m", "kvcached_service.server", *argv, "--print-config"],
                       env={**clean, **env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_unit_asks_for_cuda_and_the_default_file_allows_the_fallback():
    path = SYSTEMD / "kvcached.service"
    argv = shlex.split(unit(path)["Service"]["ExecStart"].replace("\\\n", " "))[1:]
    argv[argv.index("--socket-group") + 1] = "root"  # the ollama group does not exist here; validated at start
    env = dict(v.split("=", 1) for v in values(path, "Environment"))
    assert unit_settings(env, argv)["backend"] == "cuda"
    # /etc/default/kvcached (EnvironmentFile=, which wins) with its fallback line uncommented
    default = (SYSTEMD / "kvcached.default").read_text()
    assert "#KVCACHED_BACKEND=auto" in default
    file_env = dict(l.split("=", 1) for l in default.replace("#KVCACHED_BACKEND=auto", "KVCACHED_BACKEND=auto").splitlines()
                    if l and not l.startswith("#"))
    assert unit_settings({**env, **file_env}, argv)["backend"] == "auto"


def test_cuda_backend_without_a_driver_fails_with_status_1_which_systemd_retries(tmp_path):
    """The unit restarts on failure except status 2 (bad settings): a missing
    driver must be status 1 with a message that says so."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    env = {**clean, "PYTHONPATH": str(ROOT), "KVCACHED_BACKEND": "cuda", "KVCACHED_LIBCUDA": str(tmp_path / "no-libcuda.so.1")}
    r = subprocess.run([sys.executable, "-m", "kvcached_service.server", "--socket", str(tmp_path / "k.sock")],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert "cannot start" in r.stderr and "CUDA driver is not usable" in r.stderr, r.stderr
    assert not (tmp_path / "k.sock").exists()
    r = subprocess.run([sys.executable, "-m", "kvcached_service.server", "--backend", "gpu"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr


def test_ollama_drop_in():
    path = SYSTEMD / "ollama.service.d" / "kvcached.conf"
    u = unit(path)
    assert u["Unit"]["After"] == "kvcached.service" and u["Unit"]["Wants"] == "kvcached.service"
    env = dict(v.split("=", 1) for v in values(path, "Environment"))
    assert env == {"OLLAMA_KVCACHED_SOCKET": "/run/kvcached/kvcached.sock", "OLLAMA_FLASH_ATTENTION": "1"}


@pytest.mark.parametrize("env", [{}, {"PROMETHEUS_DISABLE_CREATED_SERIES": "true"}], ids=["by-hand", "deployed"])
def test_no_created_series(daemon_factory, env):
    """No *_created series next to the counters and histograms, whether the
    daemon is started by hand or with the deployed forms' setting."""
    d = start_with_metrics(daemon_factory, env=env)
    with d.client() as c, c.open_session("m") as s:
        s.allocate(1)
        text = scrape(d)
    assert "kvcached_rpc_requests_total{" in text and "kvcached_allocate_duration_seconds_count" in text
    created = [l for l in text.splitlines() if re.match(r"(# (HELP|TYPE) )?[a-z_]+_created[ {]", l)]
    assert not created, created


class NotifyListener:
    """The NOTIFY_SOCKET systemd would give the daemon."""

    def __init__(self, path: pathlib.Path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.messages: list[tuple[float, dict[str, str]]] = []

    def read(self, until, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while not until(self.messages):
            left = deadline - time.monotonic()
            assert left > 0, f"timed out; notify messages so far: {self.messages}"
            self.sock.settimeout(left)
            data = self.sock.recv(4096).decode()
            fields = dict(line.split("=", 1) for line in data.split("\n") if line)
            self.messages.append((time.monotonic(), fields))

    def close(self) -> None:
        self.sock.close()


def has(key: str, value: str | None = None):
    return lambda msgs: any(key in m and (value is None or m[key] == value) for _, m in msgs)


def test_sd_notify_ready_status_watchdog_stopping(daemon_factory, tmp_path):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    import grpc

    nl = NotifyListener(tmp_path / "notify")
    try:
        d = daemon_factory("host", wait=False, memory_limit="64MiB", env={"NOTIFY_SOCKET": nl.path, "WATCHDOG_USEC": "400000"})
        nl.read(has("READY", "1"))
        # READY means serving: the health service says so at that moment
        with grpc.insecure_channel(f"unix:{d.socket}") as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        ready = next(m for _, m in nl.messages if m.get("READY") == "1")
        assert ready["STATUS"].startswith("serving 0 sessions;") and "budget 64 MiB on HOST-0" in ready["STATUS"]
        # watchdog pings at half of WATCHDOG_USEC (0.2 s)
        nl.read(lambda msgs: sum(1 for _, m in msgs if m.get("WATCHDOG") == "1") >= 5)
        pings = [t for t, m in nl.messages if m.get("WATCHDOG") == "1"]
        gaps = [b - a for a, b in zip(pings, pings[1:])]
        assert max(gaps) < 0.4, gaps  # never as late as the watchdog interval itself
        with d.client() as c, c.open_session("s") as s:
            s.allocate(2)
            # STATUS is refreshed while serving
            nl.read(has("STATUS", "serving 1 session; 4 MiB in use, 0 B pooled, budget 64 MiB on HOST-0"), timeout=15)
        assert d.stop() == 0
        nl.read(has("STOPPING", "1"))
        assert not any("ERRNO" in m for _, m in nl.messages)
    finally:
        nl.close()


def test_sd_notify_watchdog_only_for_its_pid(daemon_factory, tmp_path):
    nl = NotifyListener(tmp_path / "notify")
    try:
        d = daemon_factory("host", env={"NOTIFY_SOCKET": nl.path, "WATCHDOG_USEC": "200000", "WATCHDOG_PID": "1"})
        nl.read(has("READY", "1"))
        time.sleep(0.6)
        d.stop()
        nl.read(has("STOPPING", "1"))
        assert not any("WATCHDOG" in m for _, m in nl.messages)
    finally:
        nl.close()


def test_no_notify_socket_no_messages(daemon_factory):
    d = daemon_factory("host")  # no NOTIFY_SOCKET: nothing to send, nothing logged about it
    assert d.stop() == 0
    assert "sd_notify" not in d.log_text()


# ---- Dockerfile ----------------------------------------------------------------
def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined, comments dropped."""
    text = (ROOT / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, args = line.partition(" ")
        out.append((instr.upper(), args.strip()))
    return out


def test_dockerfile_structure():
    ins = dockerfile()
    froms = [a for i, a in ins if i == "FROM"]
    assert len(froms) >= 2 and re.search(r"\bAS build\b", froms[0], re.I), froms
    final = ins[max(n for n, (i, _) in enumerate(ins) if i == "FROM"):]
    kinds = [i for i, _ in final]
    assert any(i == "COPY" and a.startswith("--from=build") for i, a in final)
    user = [a for i, a in final if i == "USER"]
    assert user and user[-1].split(":")[0] not in ("0", "root"), user
    hc = next(a for i, a in final if i == "HEALTHCHECK")
    cmd = json.loads(hc.split("CMD", 1)[1])
    assert cmd[:2] == ["kvcachedctl", "health"]
    env = " ".join(a for i, a in final if i == "ENV")
    assert "NVIDIA_VISIBLE_DEVICES=all" in env and re.search(r"NVIDIA_DRIVER_CAPABILITIES=\S*compute", env)
    assert "KVCACHED_SOCKET=/run/kvcached/kvcached.sock" in env
    entry = json.loads(next(a for i, a in final if i == "ENTRYPOINT"))
    assert entry == ["kvcached-serve"]
    assert "EXPOSE" in kinds and "STOPSIGNAL" in kinds
    # the default command is valid for kvcached-serve (parsed and validated, not started)
    args = json.loads(next(a for i, a in final if i == "CMD"))
    r = run([sys.executable, "-m", "kvcached_service.server", *args, "--print-config"])
    assert r.returncode == 0, r.stderr
    conf = json.loads(r.stdout)
    assert conf["socket"] == "/run/kvcached/kvcached.sock" and conf["socket_group"] == "2000"
    assert conf["metrics_address"] == "0.0.0.0:9461"


def test_dockerfile_copies_what_exists_and_is_not_ignored():
    ignored = [l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines() if l.strip() and not l.startswith("#")]
    for instr, args in dockerfile():
        if instr != "COPY" or args.startswith("--from"):
            continue
        for src in args.split()[:-1]:
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
            assert src.rstrip("/") not in ignored, f"COPY {src} is excluded by .dockerignore"
    for heavy in (".venv", ".git", "build", "tests"):
        assert heavy in ignored


def test_healthcheck_command_works_against_a_daemon(daemon_factory):
    """The exact HEALTHCHECK command, with the image's KVCACHED_SOCKET."""
    hc = next(a for i, a in dockerfile() if i == "HEALTHCHECK")
    cmd = json.loads(hc.split("CMD", 1)[1])
    d = daemon_factory("host")
    env = {**{k: v for k, v in os.environ.items() if k != "OLLAMA_KVCACHED_SOCKET"},
           "KVCACHED_SOCKET": d.socket, "PYTHONPATH": str(ROOT)}
    exe = [sys.executable, "-m", "kvcached_service.ctl"] + cmd[1:]
    assert subprocess.run(exe, env=env, capture_output=True, timeout=30).returncode == 0
    d.stop()
    assert subprocess.run(exe, env=env, capture_output=True, timeout=30).returncode != 0


# ---- Kubernetes -----------------------------------------------------------------
def k8s_docs() -> dict[str, dict]:
    out = {}
    for f in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            if doc:
                out[f"{doc['kind']}/{doc.get('metadata', {}).get('name', '')}"] = doc
    return out


def test_k8s_daemonset():
    docs = k8s_docs()
    ds = docs["DaemonSet/kvcached"]
    assert ds["apiVersion"] == "apps/v1"
    spec = ds["spec"]
    tmpl = spec["template"]
    assert spec["selector"]["matchLabels"].items() <= tmpl["metadata"]["labels"].items()
    ann = tmpl["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
    pod = tmpl["spec"]
    (c,) = pod["containers"]
    args = build_parser().parse_args(c["args"])
    assert args.socket == "/run/kvcached/kvcached.sock"
    port = int(args.metrics_address.rsplit(":", 1)[1])
    assert ann["prometheus.io/port"] == str(port)
    assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in c["ports"]
    # the socket directory is the node's /run/kvcached
    vols = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    hp = vols[mounts["/run/kvcached"]]["hostPath"]
    assert hp["path"] == "/run/kvcached" and hp["type"] == "DirectoryOrCreate"
    # exec probes through the gRPC health service on that socket
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        cmd = c[probe]["exec"]["command"]
        assert cmd[:2] == ["kvcachedctl", "health"] and cmd[cmd.index("--socket") + 1] == args.socket, probe
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"] and c["resources"]["limits"]["memory"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and "compute" in env["NVIDIA_DRIVER_CAPABILITIES"]
    assert env["KVCACHED_BACKEND"] == "cuda" and env["PROMETHEUS_DISABLE_CREATED_SERIES"] == "true"
    # hostPath: the namespace runs at the privileged Pod Security level
    ns = docs["Namespace/kvcached"]["metadata"]["labels"]
    assert ns["pod-security.kubernetes.io/enforce"] == "privileged"
    assert pod["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["terminationGracePeriodSeconds"] >= 10
    # the init container hands the directory to the daemon's uid and the socket group
    init = pod["initContainers"][0]
    assert f"chown {pod['securityContext']['runAsUser']}:{args.socket_group}" in " ".join(init["command"])


def test_k8s_example_client_matches_the_daemonset():
    docs = k8s_docs()
    ds = docs["DaemonSet/kvcached"]["spec"]["template"]["spec"]
    args = build_parser().parse_args(ds["containers"][0]["args"])
    pod = docs["Pod/ollama"]["spec"]
    assert int(args.socket_group) in pod["securityContext"]["supplementalGroups"]
    (c,) = pod["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["OLLAMA_KVCACHED_SOCKET"] == args.socket and env["OLLAMA_FLASH_ATTENTION"] == "1"
    vol = {v["name"]: v for v in pod["volumes"]}[c["volumeMounts"][0]["name"]]
    assert vol["hostPath"]["path"] == os.path.dirname(args.socket)
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert set(kust["resources"]) == {"namespace.yaml", "daemonset.yaml"}


def k8s_files() -> list[pathlib.Path]:
    return sorted(f for f in K8S.glob("*.yaml") if f.name != "kustomization.yaml")


@pytest.mark.parametrize("version", ["1.25", "1.37"])
def test_k8s_manifests_validate_against_the_api_schemas(version):
    """Strict validation (unknown fields are errors) against the Kubernetes
    OpenAPI schemas the kubernetes-validate package ships, for the oldest and
    newest version it carries."""
    import kubernetes_validate

    n = 0
    for f in k8s_files():
        for doc in yaml.safe_load_all(f.read_text()):
            if doc:
                kubernetes_validate.validate(doc, version, strict=True)
                n += 1
    assert n == 3  # Namespace, DaemonSet, Pod
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())  # no schema for Kustomization: its files exist
    assert all((K8S / r).is_file() for r in kust["resources"])


def test_k8s_schema_validation_catches_a_misspelt_field():
    import kubernetes_validate

    ds = next(d for d in yaml.safe_load_all((K8S / "daemonset.yaml").read_text()) if d)
    c = ds["spec"]["template"]["spec"]["containers"][0]
    c["livenessProbe"]["exec"]["comand"] = c["livenessProbe"]["exec"].pop("command")
    with pytest.raises(kubernetes_validate.ValidationError, match="comand"):
        kubernetes_validate.validate(ds, "1.37", strict=True)
    ds = next(d for d in yaml.safe_load_all((K8S / "daemonset.yaml").read_text()) if d)
    ds["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "30"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, "1.37", strict=True)
