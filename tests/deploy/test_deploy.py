"""The deployment files agree with the worker and with each other.

``docker-compose.yml``, ``Dockerfile``, ``.dockerignore`` and ``deploy/``
(Prometheus config and alert rules, Grafana provisioning and dashboard) are
checked against the worker's real settings (``workers.settings``), metrics
(``workers.runtime.metrics``) and command line (``gnnstream run --help``), and
Prometheus' files with ``promtool`` (installed by ``deploy/install-promtool.sh``
when missing; these tests fail, never skip, when it cannot be had).
No Docker engine is needed.

The compose file runs several workers of one group (the services whose command
is ``run``): every check on "the worker" holds for each of them, and
``test_workers_form_one_group`` checks what sets them apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from gnnstream.model import load_model_dir
from gnnstream.stream.snap import FEATURE_DIM
from gnnstream.workers.runtime.metrics import MetricsServer, WorkerMetrics
from gnnstream.workers.settings import ENV_PREFIX, WorkerSettings, add_worker_arguments, settings_from_args

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
RULES = ROOT / "deploy" / "prometheus" / "gnnstream.rules.yml"
RULES_TEST = ROOT / "deploy" / "prometheus" / "tests" / "gnnstream.rules.test.yml"
INSTALL_PROMTOOL = ROOT / "deploy" / "install-promtool.sh"
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "gnnstream.json"
DOCS = ROOT / "docs" / "deployment.md"

SETTINGS = {f.name: f for f in dataclasses.fields(WorkerSettings)}
METRIC_TOKEN = re.compile(r"\bgnnstream_[a-z0-9_]+\b")


# ---------------------------------------------------------------------- helpers
def _yaml(path: Path) -> Any:
    with open(path) as fh:
        return yaml.safe_load(fh)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _yaml(COMPOSE)


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    return compose["services"]


@pytest.fixture(scope="module")
def workers(services: dict[str, Any]) -> dict[str, Any]:
    """The worker services: those that run ``gnnstream run``, by service name."""
    found = {name: s for name, s in services.items() if s.get("command") == ["run"]}
    assert "gnnstream" in found, "the gnnstream service must run `gnnstream run`"
    assert len(found) >= 2, f"expected at least two workers of one group, found {sorted(found)}"
    return found


@pytest.fixture(scope="module")
def worker_envs(workers: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Each worker service's environment."""
    envs = {}
    for name, service in workers.items():
        env = service["environment"]
        assert isinstance(env, dict), f"give the {name} service's environment as a mapping"
        envs[name] = env
    return envs


def _port_pairs(service: dict[str, Any]) -> list[tuple[int, int]]:
    """``"HOST:CONTAINER"`` port entries as ``(host, container)``."""
    pairs = []
    for entry in service.get("ports", []):
        assert isinstance(entry, str) and re.fullmatch(r"\d+:\d+", entry), f"expected 'HOST:CONTAINER', got {entry!r}"
        host, container = entry.split(":")
        pairs.append((int(host), int(container)))
    return pairs


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """``{container path: source}`` of a service's short-syntax volumes."""
    out = {}
    for entry in service.get("volumes", []):
        source, target, *_ = entry.split(":")
        out[target] = source
    return out


def _listeners(value: str) -> dict[str, str]:
    """``"NAME://host:port,..."`` -> ``{NAME: "host:port"}``."""
    out = {}
    for item in value.split(","):
        name, _, address = item.strip().partition("://")
        assert name and address, f"malformed listener {item!r}"
        out[name] = address
    return out


def _metric_names() -> dict[str, set[str]]:
    """Every series name the worker exposes -> its label names (histograms' ``le`` included).

    Derived from ``WorkerMetrics().render()``: a labelled metric that has not
    been used yet has no samples, so names come from the ``# TYPE`` lines with
    the suffixes Prometheus gives each type.
    """
    metrics = WorkerMetrics()
    text = metrics.render().decode()
    labels: dict[str, tuple[str, ...]] = {}
    for value in vars(metrics).values():
        names = getattr(value, "_labelnames", None)
        if names is not None:
            labels[value._name] = tuple(names)
    suffixes = {"counter": ("_total", "_created"), "gauge": ("",),
                "histogram": ("_bucket", "_count", "_sum", "_created"), "summary": ("", "_count", "_sum", "_created")}
    out: dict[str, set[str]] = {}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M):
        base = name[: -len("_total")] if kind == "counter" and name.endswith("_total") else name
        for suffix in suffixes[kind]:
            extra = {"le"} if suffix == "_bucket" else set()
            out[base + suffix] = set(labels.get(base, ())) | extra
    return out


# Labels Prometheus adds to every scraped series (deploy/prometheus/prometheus.yml).
TARGET_LABELS = {"job", "instance", "service"}


def _check_promql(expr: str, known: dict[str, set[str]], where: str) -> set[str]:
    """Every gnnstream_* name in ``expr`` exists; its ``by (...)`` / selector labels too. Returns the names."""
    names = set(METRIC_TOKEN.findall(expr))
    for name in names:
        assert name in known, f"{where}: {name} is not a metric of workers.runtime.metrics.WorkerMetrics ({expr})"
    allowed = set().union(*(known[n] for n in names)) | TARGET_LABELS if names else TARGET_LABELS
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        for label in filter(None, (x.strip() for x in group.split(","))):
            assert label in allowed, f"{where}: label {label!r} is not a label of {sorted(names)} ({expr})"
    for selector in re.findall(r"gnnstream_[a-z0-9_]+\{([^}]*)\}", expr):
        for label in re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", selector):
            assert label in allowed, f"{where}: label {label!r} is not a label of {sorted(names)} ({expr})"
    return names


# ---------------------------------------------------------------------- promtool
@pytest.fixture(scope="session")
def promtool() -> str:
    """promtool's path, installed with deploy/install-promtool.sh when missing. Fails (never skips) otherwise."""
    try:
        result = subprocess.run(["bash", str(INSTALL_PROMTOOL)], capture_output=True, text=True, timeout=540)
    except subprocess.TimeoutExpired:
        pytest.fail("deploy/install-promtool.sh did not finish within 9 minutes")
    if result.returncode != 0:
        pytest.fail("promtool is needed to check deploy/prometheus/ and could not be obtained: "
                    f"deploy/install-promtool.sh exited {result.returncode}\n{result.stderr[-3000:]}")
    path = result.stdout.strip().splitlines()[-1]
    assert os.access(path, os.X_OK), f"install-promtool.sh printed {path!r}, which is not an executable"
    return path


def _promtool(promtool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.xdist_group("promtool")  # one process installs promtool on a fresh machine
def test_promtool_check_config(promtool: str) -> None:
    result = _promtool(promtool, "check", "config", str(PROMETHEUS.relative_to(ROOT)))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "SUCCESS: deploy/prometheus/prometheus.yml is valid prometheus config file syntax" in out, out
    rules = sum(len(g["rules"]) for g in _yaml(RULES)["groups"])
    assert f"SUCCESS: {rules} rules found" in out, out  # the rule file is found and parsed as well


@pytest.mark.xdist_group("promtool")
def test_promtool_alert_rules_unit_tests(promtool: str) -> None:
    result = _promtool(promtool, "check", "rules", str(RULES.relative_to(ROOT)))
    assert result.returncode == 0, result.stdout + result.stderr
    result = _promtool(promtool, "test", "rules", str(RULES_TEST.relative_to(ROOT)))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "SUCCESS" in out, out


def test_alert_rules_use_real_metrics(worker_envs: dict[str, dict[str, str]]) -> None:
    known = _metric_names()
    rules = [r for g in _yaml(RULES)["groups"] for r in g["rules"]]
    used = set()
    for rule in rules:
        used |= _check_promql(rule["expr"], known, f"alert {rule['alert']}")
    assert {"gnnstream_consumer_lag", "gnnstream_invalid_events_total", "gnnstream_deferred_staleness_seconds",
            "gnnstream_errors_total", "gnnstream_owned_partitions"} <= used
    by_name = {r["alert"]: r for r in rules}
    job = _yaml(PROMETHEUS)["scrape_configs"][0]["job_name"]
    # one alert per worker that is down (up keeps the instance label)
    assert by_name["GnnstreamDown"]["expr"] == f'up{{job="{job}"}} == 0'
    # every output partition is published by some worker: the threshold is the compose file's partition count
    (partitions,) = {env["GNNSTREAM_PARTITIONS"] for env in worker_envs.values()}
    assert by_name["GnnstreamOutputPartitionsUnowned"]["expr"] == \
        f'sum(gnnstream_owned_partitions{{job="{job}"}}) < {int(partitions)}'
    assert f"of the {int(partitions)} output partitions" in \
        by_name["GnnstreamOutputPartitionsUnowned"]["annotations"]["summary"]
    # what one worker does (lag, staleness, retries) is judged per worker ...
    for alert in ("GnnstreamConsumerLagHigh", "GnnstreamDeferredHubsStale", "GnnstreamRecoverableErrors"):
        expr = by_name[alert]["expr"]
        assert re.match(r"\w+ by \(instance\b", expr), f"{alert} must be per worker (by instance): {expr}"
        assert "{{ $labels.instance }}" in by_name[alert]["annotations"]["summary"], alert
    # ... invalid events, which every worker reads and counts, once: the largest count, not the sum
    assert by_name["GnnstreamDeadLetters"]["expr"].startswith("max by (reason) (rate(gnnstream_invalid_events_total[")


# ---------------------------------------------------------------------- the worker service
def test_worker_env_vars_are_real_settings(worker_envs: dict[str, dict[str, str]],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    assert ENV_PREFIX == "GNNSTREAM_"
    kafka_env = _yaml(COMPOSE)["services"]["kafka"]["environment"]
    min_session = int(kafka_env.get("KAFKA_GROUP_MIN_SESSION_TIMEOUT_MS", 6000))
    for service, worker_env in worker_envs.items():
        for name, value in worker_env.items():
            assert name.startswith(ENV_PREFIX), f"{service}: {name}: a worker should only set GNNSTREAM_* variables"
            field = name[len(ENV_PREFIX):].lower()
            assert field in SETTINGS, f"{service}: {name} is not a setting of workers.settings.WorkerSettings"
            assert isinstance(value, str), f"{service}: {name}: quote the value ({value!r}) so YAML keeps it a string"
        # the essential ones are set
        for field in ("bootstrap", "state", "model", "metrics_port", "group", "worker_id"):
            assert ENV_PREFIX + field.upper() in worker_env, f"{service} does not set {ENV_PREFIX + field.upper()}"
        # The values parse the way `gnnstream run` parses them (ints, floats, choices).
        with monkeypatch.context() as mp:
            for name in list(os.environ):
                if name.startswith(ENV_PREFIX):
                    mp.delenv(name)
            for name, value in worker_env.items():
                mp.setenv(name, value)
            parser = argparse.ArgumentParser()
            add_worker_arguments(parser)
            settings = settings_from_args(parser.parse_args([]))
        for name, value in worker_env.items():
            field = name[len(ENV_PREFIX):].lower()
            parsed = getattr(settings, field)
            kind = type(SETTINGS[field].default) if SETTINGS[field].default is not None else str
            assert parsed == kind(value) and type(parsed) is kind, f"{service}: {name}={value!r} parsed as {parsed!r}"
        assert settings.output_format in ("json", "binary")
        assert settings.session_timeout_ms >= min_session, \
            f"{service}: the broker would refuse the consumer group's session timeout"


def test_run_help_mentions_every_env_var(worker_envs: dict[str, dict[str, str]]) -> None:
    from tests.workers.reference import call_gnnstream
    result = call_gnnstream("run", "--help")
    assert result.returncode == 0, result.stderr
    help_text = result.stdout
    for name in set().union(*worker_envs.values()):
        assert name in help_text, f"`gnnstream run --help` does not mention {name}"
    for field in SETTINGS:  # and every setting's variable, including those the compose file leaves at default
        assert ENV_PREFIX + field.upper() in help_text


def test_metrics_port_exposed_and_scraped(workers: dict[str, Any], worker_envs: dict[str, dict[str, str]]) -> None:
    dockerfile = DOCKERFILE.read_text()
    scrape = {c["job_name"]: c for c in _yaml(PROMETHEUS)["scrape_configs"]}
    job = scrape["gnnstream"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    # Every worker, and nothing else, is a target: the compose service name on the metrics port, each with a
    # `service` label naming it (the targets, hence `instance`, differ too).
    targets = {t: sc.get("labels", {}) for sc in job["static_configs"] for t in sc["targets"]}
    assert len(targets) == sum(len(sc["targets"]) for sc in job["static_configs"]), "a target is listed twice"
    expected = {f"{name}:{env['GNNSTREAM_METRICS_PORT']}": name for name, env in worker_envs.items()}
    assert set(targets) == set(expected), "Prometheus must scrape every worker service on its metrics port"
    for target, name in expected.items():
        assert targets[target].get("service") == name, f"{target}: label it service: {name}"
    for name, env in worker_envs.items():
        port = int(env["GNNSTREAM_METRICS_PORT"])
        assert port == WorkerSettings.metrics_port == 9108
        assert port in [container for _host, container in _port_pairs(workers[name])], \
            f"{name}: publish the metrics port {port}"
        assert re.search(rf"^EXPOSE {port}$", dockerfile, flags=re.M)
        assert re.search(rf"GNNSTREAM_METRICS_PORT={port}\b", dockerfile)
    # the first worker keeps the default ports on the host too
    assert (9108, 9108) in _port_pairs(workers["gnnstream"])


def test_query_port_published_on_every_interface(workers: dict[str, Any],
                                                 worker_envs: dict[str, dict[str, str]]) -> None:
    for name, env in worker_envs.items():
        port = int(env["GNNSTREAM_QUERY_PORT"])
        assert port and port != int(env["GNNSTREAM_METRICS_PORT"])
        assert env["GNNSTREAM_QUERY_HOST"] == "0.0.0.0", \
            f"{name}: inside the container 127.0.0.1 is unreachable from the host"
        assert port in [container for _host, container in _port_pairs(workers[name])], \
            f"{name}: publish the query port {port}"
    assert (8080, 8080) in _port_pairs(workers["gnnstream"])


def test_bootstrap_is_an_advertised_kafka_listener(services: dict[str, Any], workers: dict[str, Any],
                                                   worker_envs: dict[str, dict[str, str]]) -> None:
    kafka = services["kafka"]
    env = kafka["environment"]
    assert kafka["image"].startswith("apache/kafka:")
    listeners = _listeners(env["KAFKA_LISTENERS"])
    advertised = _listeners(env["KAFKA_ADVERTISED_LISTENERS"])
    protocols = dict(item.split(":") for item in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    assert set(listeners) == set(protocols), "every listener needs a security protocol"
    assert set(advertised) <= set(listeners)
    for name, address in advertised.items():  # advertised on the port it listens on
        assert address.rsplit(":", 1)[1] == listeners[name].rsplit(":", 1)[1], name

    # Each worker connects to the in-network listener: the kafka service's name and that listener's port.
    for name, worker_env in worker_envs.items():
        bootstrap = worker_env["GNNSTREAM_BOOTSTRAP"]
        assert bootstrap in advertised.values(), f"{name}: {bootstrap} is not advertised by kafka ({advertised})"
        host = bootstrap.rsplit(":", 1)[0]
        assert host in ("kafka", kafka.get("hostname")), name
    # Host clients (`gnnstream produce --bootstrap localhost:9092`) use the published one.
    assert "localhost:9092" in advertised.values()
    host_listener = next(n for n, a in advertised.items() if a == "localhost:9092")
    assert (9092, int(listeners[host_listener].rsplit(":", 1)[1])) in _port_pairs(kafka)
    assert env["KAFKA_INTER_BROKER_LISTENER_NAME"] in advertised

    # KRaft, single node: broker + controller, the controller listener in the voters.
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    controller = env["KAFKA_CONTROLLER_LISTENER_NAMES"]
    assert controller in listeners and controller not in advertised
    voter_id, _, voter = env["KAFKA_CONTROLLER_QUORUM_VOTERS"].partition("@")
    assert voter_id == env["KAFKA_NODE_ID"]
    assert voter == f"kafka:{listeners[controller].rsplit(':', 1)[1]}"
    assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "1"
    assert env["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"] == "1"
    assert re.fullmatch(r"[A-Za-z0-9_-]{22}", env["CLUSTER_ID"]), "CLUSTER_ID: 16 bytes, base64url"
    assert _mounts(kafka)[env["KAFKA_LOG_DIRS"]] == "kafka-data"

    # Every worker waits for a healthy broker and for the model.
    for name, worker in workers.items():
        deps = worker["depends_on"]
        assert deps["kafka"]["condition"] == "service_healthy", name
        assert deps["model-init"]["condition"] == "service_completed_successfully", name
    assert "healthcheck" in kafka


def test_state_and_model_volumes(compose: dict[str, Any], services: dict[str, Any], workers: dict[str, Any],
                                 worker_envs: dict[str, dict[str, str]]) -> None:
    dockerfile = DOCKERFILE.read_text()
    assert 'VOLUME ["/var/lib/gnnstream"]' in dockerfile
    assert _mounts(workers["gnnstream"])["/var/lib/gnnstream"] == "gnnstream-state"
    for name, worker in workers.items():
        mounts = _mounts(worker)
        worker_env = worker_envs[name]
        volume = mounts.get("/var/lib/gnnstream")
        assert volume in compose["volumes"], f"{name}: mount a named volume of its own on /var/lib/gnnstream"
        state = worker_env["GNNSTREAM_STATE"]
        assert state.startswith("/var/lib/gnnstream/"), f"{name}: the state must live on the state volume"
        assert f"GNNSTREAM_STATE={state}" in dockerfile  # the image's default is the same
        model = worker_env["GNNSTREAM_MODEL"]
        assert model.startswith("/models/") and mounts["/models"] == "models", name
        assert "models:/models:ro" in worker["volumes"], f"{name}: mount the models read-only"
    assert _mounts(services["model-init"])["/models"] == "models"
    for volume in ("gnnstream-state", "models", "kafka-data"):
        assert volume in compose["volumes"]


def _model_init_script(services: dict[str, Any]) -> str:
    init = services["model-init"]
    assert init["entrypoint"] == ["/bin/sh", "-c"]
    (script,) = init["command"]
    return script


def test_model_init_creates_the_worker_model_once(services: dict[str, Any], worker_envs: dict[str, dict[str, str]],
                                                  tmp_path: Path) -> None:
    script = _model_init_script(services)
    (model_dir,) = {env["GNNSTREAM_MODEL"] for env in worker_envs.values()}  # every worker uses the one model
    words = shlex.split(script)
    i = words.index("init")
    assert words[i - 2: i + 2] == ["gnnstream", "model", "init", model_dir]
    assert int(words[words.index("--in-dim") + 1]) == FEATURE_DIM, "the model must take the SNAP events' features"
    assert f"test -f {model_dir}/config.json ||" in script
    assert services["model-init"].get("restart") == "no"

    # Run the service's own script, with /models on a temporary directory and this venv's gnnstream.
    local = script.replace("/models/", f"{tmp_path}/models/")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    first = subprocess.run(["/bin/sh", "-c", local], capture_output=True, text=True, timeout=300, env=env)
    assert first.returncode == 0, first.stderr
    created = tmp_path / model_dir.lstrip("/")
    loaded = load_model_dir(created)
    assert loaded.config.in_dim == FEATURE_DIM
    assert loaded.config.name == "otc-sage"
    assert json.loads(first.stdout)["in_dim"] == FEATURE_DIM
    weights = {p.name: p.read_bytes() for p in created.iterdir()}
    second = subprocess.run(["/bin/sh", "-c", local], capture_output=True, text=True, timeout=300, env=env)
    assert second.returncode == 0, second.stderr
    assert second.stdout == "", "a second run must leave the existing model alone"
    assert {p.name: p.read_bytes() for p in created.iterdir()} == weights


def _healthcheck_argv(worker: dict[str, Any]) -> list[str]:
    test = worker["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1] == "python"
    assert "/healthz" in test[-1] and "GNNSTREAM_METRICS_PORT" in test[-1]
    return [sys.executable, *test[2:]]


@pytest.mark.parametrize("ok", [True, False])
def test_worker_healthcheck_probes_healthz(workers: dict[str, Any], ok: bool) -> None:
    (argv,) = {tuple(_healthcheck_argv(worker)) for worker in workers.values()}  # one probe for every worker
    server = MetricsServer(WorkerMetrics(), 0, lambda: {"ok": ok}, host="127.0.0.1")
    try:
        env = dict(os.environ, GNNSTREAM_METRICS_PORT=str(server.port))
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    finally:
        server.close()
    assert (result.returncode == 0) is ok, result.stderr
    # and with nothing listening, the probe fails
    env = dict(os.environ, GNNSTREAM_METRICS_PORT=str(server.port))
    assert subprocess.run(argv, capture_output=True, timeout=60, env=env).returncode != 0


def test_images_are_pinned(services: dict[str, Any], workers: dict[str, Any]) -> None:
    images = {name: s["image"] for name, s in services.items()}
    assert images["kafka"].startswith("apache/kafka:")
    assert images["prometheus"].startswith("prom/prometheus:v")
    assert images["grafana"].startswith("grafana/grafana:")
    for name, image in images.items():
        repo, _, tag = image.rpartition(":")
        assert repo and re.fullmatch(r"v?\d+\.\d+\.\d+", tag), f"{name}: pin a version tag, not {image!r}"
    for name, worker in workers.items():  # every worker runs the image model-init runs, built from here
        assert worker["build"] == services["model-init"]["build"], name
        assert worker["build"]["context"] == ".", name
        assert images[name] == images["model-init"], name


def _merged(node: yaml.MappingNode) -> set[int]:
    """The YAML nodes a mapping merges with ``<<`` (as ids: an alias is the anchored node itself)."""
    out: set[int] = set()
    for key, value in node.value:
        if key.tag == "tag:yaml.org,2002:merge":
            out |= {id(n) for n in value.value} if isinstance(value, yaml.SequenceNode) else {id(value)}
    return out


def _node(mapping: yaml.MappingNode, key: str) -> yaml.Node:
    return next(v for k, v in mapping.value if k.value == key)


def test_workers_form_one_group(compose: dict[str, Any], services: dict[str, Any], workers: dict[str, Any],
                                worker_envs: dict[str, dict[str, str]]) -> None:
    """The workers: one image, one group, one set of settings; their own name, state volume and host ports."""
    names = sorted(workers)
    # one group; a name of its own for each worker (it also names the worker's consumer of the events topic)
    groups = {env["GNNSTREAM_GROUP"] for env in worker_envs.values()}
    assert len(groups) == 1 and all(groups), f"every worker must be in one group (GNNSTREAM_GROUP: {groups})"
    ids = [env["GNNSTREAM_WORKER_ID"] for env in worker_envs.values()]
    assert all(ids) and len(set(ids)) == len(ids), f"each worker needs a GNNSTREAM_WORKER_ID of its own: {ids}"
    # every other setting is the same: they read the same topics and compute with the same model
    shared = {name: {k: v for k, v in env.items() if k != "GNNSTREAM_WORKER_ID"} for name, env in worker_envs.items()}
    for name in names:
        assert shared[name] == shared["gnnstream"], f"{name}'s settings differ from gnnstream's"
    others = {name: {k: v for k, v in w.items() if k not in ("environment", "ports", "volumes")}
              for name, w in workers.items()}
    for name in names:
        assert others[name] == others["gnnstream"], f"{name} differs from gnnstream beyond settings, ports, volumes"
    # the output partitions split evenly between the workers
    partitions = int(shared["gnnstream"]["GNNSTREAM_PARTITIONS"])
    assert partitions % len(workers) == 0, f"{partitions} partitions do not split evenly among {len(workers)} workers"
    # a state volume of its own for each worker, mounted by no other service
    volumes = {name: _mounts(w)["/var/lib/gnnstream"] for name, w in workers.items()}
    assert len(set(volumes.values())) == len(volumes), f"workers share a state volume: {volumes}"
    for name, service in services.items():
        if name not in workers:
            assert not set(volumes.values()) & set(_mounts(service).values()), f"{name} mounts a worker's state"
    # host ports: none taken twice in the whole stack; each worker publishes the same container ports
    host_ports = [host for service in services.values() for host, _ in _port_pairs(service)]
    assert len(host_ports) == len(set(host_ports)), f"a host port is published twice: {sorted(host_ports)}"
    container_ports = {name: sorted(c for _, c in _port_pairs(w)) for name, w in workers.items()}
    for name in names:
        assert container_ports[name] == container_ports["gnnstream"], name
    # Shared through YAML anchors, not copies: each worker service merges one common node, and its
    # environment one common mapping of settings.
    with open(COMPOSE) as fh:
        root = yaml.compose(fh, Loader=yaml.SafeLoader)
    service_nodes = _node(root, "services")
    worker_nodes = [_node(service_nodes, name) for name in names]
    assert set.intersection(*(_merged(n) for n in worker_nodes)), "merge one anchored worker definition (<<: *...)"
    env_nodes = [_node(n, "environment") for n in worker_nodes]
    assert set.intersection(*(_merged(n) for n in env_nodes)), "merge one anchored environment (<<: *...)"
    for name, node in zip(names, env_nodes):
        own = [k.value for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge"]
        assert own == ["GNNSTREAM_WORKER_ID"], f"{name}: set only GNNSTREAM_WORKER_ID beside the shared settings"


# ---------------------------------------------------------------------- Prometheus and Grafana
def test_prometheus_service_uses_the_checked_files(services: dict[str, Any]) -> None:
    prom = services["prometheus"]
    mounts = _mounts(prom)
    config_arg = next(a for a in prom["command"] if a.startswith("--config.file="))
    config_path = config_arg.split("=", 1)[1]
    assert mounts[config_path] == "./deploy/prometheus/prometheus.yml"
    for rule_file in _yaml(PROMETHEUS)["rule_files"]:  # relative to the config file in both places
        assert (PROMETHEUS.parent / rule_file).is_file()
        assert mounts[str(Path(config_path).parent / rule_file)] == f"./deploy/prometheus/{rule_file}"
    assert (9090, 9090) in _port_pairs(prom)


def test_grafana_provisioning_matches_compose(services: dict[str, Any]) -> None:
    grafana = services["grafana"]
    mounts = _mounts(grafana)
    assert mounts["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    (datasource,) = _yaml(GRAFANA / "provisioning" / "datasources" / "prometheus.yml")["datasources"]
    prom_port = _port_pairs(services["prometheus"])[0][1]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == f"http://prometheus:{prom_port}"
    assert datasource["jsonData"]["timeInterval"] == _yaml(PROMETHEUS)["global"]["scrape_interval"]
    (provider,) = _yaml(GRAFANA / "provisioning" / "dashboards" / "gnnstream.yml")["providers"]
    dashboards_dir = provider["options"]["path"]
    assert mounts[dashboards_dir] == "./deploy/grafana/dashboards"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{dashboards_dir}/{DASHBOARD.name}"
    assert (3000, 3000) in _port_pairs(grafana)
    # every panel and query uses the provisioned datasource
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == datasource["uid"], panel["title"]


def _sums(expr: str) -> list[tuple[str, str]]:
    """Every ``sum`` aggregation in a PromQL expression as ``(by-clause labels, argument)``."""
    out = []
    for match in re.finditer(r"\bsum\s*(?:by\s*\(([^)]*)\)\s*)?\(", expr):
        depth, start = 1, match.end()
        for i in range(start, len(expr)):
            depth += {"(": 1, ")": -1}.get(expr[i], 0)
            if depth == 0:
                break
        else:
            pytest.fail(f"unbalanced parentheses in {expr}")
        out.append((match.group(1) or "", expr[start:i]))
    return out


def test_dashboard_uses_real_metrics_and_has_the_panels() -> None:
    known = _metric_names()
    dashboard = json.loads(DASHBOARD.read_text())
    panels = {p["title"]: p for p in dashboard["panels"]}
    assert len(panels) == len(dashboard["panels"]), "panel titles must be unique"
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    used: set[str] = set()
    for title, panel in panels.items():
        assert panel["targets"], title
        for name in METRIC_TOKEN.findall(panel.get("description", "")):
            assert name in known, f"panel {title!r}: the description names {name}, not a metric of the worker"
        for target in panel["targets"]:
            expr = target["expr"]
            used |= _check_promql(expr, known, f"panel {title!r}")
            for name in METRIC_TOKEN.findall(expr):  # buckets only inside a quantile over le
                if name.endswith("_bucket"):
                    assert expr.startswith("histogram_quantile(") and "by (le)" in expr, f"{title}: {expr}"
                if name.endswith("_total"):
                    assert f"rate({name}[" in expr, f"{title}: plot counters as rates ({expr})"

    def exprs(title: str) -> str:
        assert title in panels, f"missing panel {title!r}"
        return " ".join(t["expr"] for t in panels[title]["targets"])

    assert "max by (op) (rate(gnnstream_events_total[" in exprs("Events/s by op")
    assert "gnnstream_consumer_lag" in exprs("Consumer lag by partition")
    for title, metric in (("Embedding freshness p50 / p99", "gnnstream_embedding_freshness_seconds_bucket"),
                          ("Pipeline latency p50 / p99", "gnnstream_pipeline_latency_seconds_bucket")):
        text = exprs(title)
        assert f"histogram_quantile(0.5, sum by (le) (rate({metric}[" in text
        assert f"histogram_quantile(0.99, sum by (le) (rate({metric}[" in text
    assert "by (layer)" in exprs("Dirty nodes per layer") and "gnnstream_dirty_nodes" in exprs("Dirty nodes per layer")
    assert "max by (reason) (rate(gnnstream_invalid_events_total[" in exprs("Dead letters/s by reason")
    assert "rate(gnnstream_embeddings_published_total[" in exprs("Published embeddings/s")
    assert "histogram_quantile(0.99, sum by (le) (rate(gnnstream_recompute_seconds_bucket[" in \
        exprs("Batch latency p99 (recompute / apply / publish)")
    deferred = exprs("Deferred hubs and staleness")
    assert "gnnstream_deferred_hubs" in deferred and "gnnstream_deferred_staleness_seconds" in deferred
    assert "gnnstream_owned_partitions" in exprs("Owned output partitions by worker")
    assert "{{instance}}" in panels["Owned output partitions by worker"]["targets"][0]["legendFormat"]
    # Every worker reads every event: what they count of the event stream must not be added up across
    # workers (that counts each event once per worker); sum only within one worker (by instance).
    per_stream = ("gnnstream_events_total", "gnnstream_consumer_lag", "gnnstream_invalid_events_total",
                  "gnnstream_deferred_hubs")
    for title, panel in panels.items():
        for target in panel["targets"]:
            expr = target["expr"]
            for by, argument in _sums(expr):
                for metric in per_stream:
                    assert not (re.search(rf"\b{metric}\b", argument) and "instance" not in by), \
                        f"panel {title!r} adds up {metric} across workers: {expr}"
    # every metric family of the worker is on the dashboard somewhere
    families = {re.sub(r"_(bucket|count|sum|created|total)$", "", n) for n in known}
    shown = {re.sub(r"_(bucket|count|sum|created|total)$", "", n) for n in used}
    assert families <= shown, f"not on the dashboard: {sorted(families - shown)}"


# ---------------------------------------------------------------------- the image
def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile() -> None:
    instructions = _dockerfile_instructions()
    by = lambda word: [rest for w, rest in instructions if w == word]  # noqa: E731
    assert by("FROM") == ["python:3.11-slim"]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["requires-python"] == ">=3.11"
    (torch_pin,) = [d for d in pyproject["project"]["dependencies"] if d.startswith("torch")]
    runs = by("RUN")
    torch_run = next(r for r in runs if "torch" in r)
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch_run
    assert torch_pin in torch_run.split(), f"the image must install the pyproject pin {torch_pin}"
    assert runs.index(torch_run) < next(i for i, r in enumerate(runs) if "pip install ." in r)
    users = by("USER")
    assert users and users[-1] not in ("root", "0"), "the image must run as a non-root user"
    assert json.loads(by("ENTRYPOINT")[-1]) == ["gnnstream"]
    assert json.loads(by("CMD")[-1]) == ["run"]
    assert by("EXPOSE") == [str(WorkerSettings.metrics_port)]
    assert by("VOLUME") == ['["/var/lib/gnnstream"]']
    assert "/healthz" in by("HEALTHCHECK")[-1]
    # The entry point is the console script pyproject.toml declares.
    assert pyproject["project"]["scripts"]["gnnstream"] == "gnnstream.workers.cli:main"


def _docker_ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore excludes ``path`` (Docker's rules: last match wins; a match on a parent counts)."""

    def regex(pattern: str) -> re.Pattern[str]:
        out = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out += "(?:.*/)?"
                i += 3
            elif pattern.startswith("**", i):
                out += ".*"
                i += 2
            elif pattern[i] == "*":
                out += "[^/]*"
                i += 1
            elif pattern[i] == "?":
                out += "[^/]"
                i += 1
            else:
                out += re.escape(pattern[i])
                i += 1
        return re.compile(out + r"\Z")

    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        pattern = pattern.strip("/")
        rx = regex(pattern)
        if any(rx.match(p) for p in prefixes):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_the_build_context_small_and_complete() -> None:
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.strip().startswith("#")]
    for path in (".venv/bin/python", ".git/HEAD", "state/CURRENT", "state-otc/000001.log", "out/result.json",
                 ".pytest_cache/v", ".hypothesis/x", "tests/conftest.py", "gnnstream.egg-info/PKG-INFO",
                 "workers/__pycache__/cli.cpython-311.pyc", "model/weights.pt", "docker-compose.yml"):
        assert _docker_ignored(path, patterns), f"{path} should not be in the build context"
    needed = ["pyproject.toml", "README.md"]
    packages = sorted(set(_package_dirs().values()))
    for package in packages:
        files = sorted((ROOT / package).glob("*.py"))
        assert files, package
        needed += [f.relative_to(ROOT).as_posix() for f in files]
    for path in needed:
        assert not _docker_ignored(path, patterns), f"{path} is needed by `pip install .` but .dockerignore drops it"
    # every COPY source exists and is in the context; every package is copied
    copied = []
    for word, rest in _dockerfile_instructions():
        if word == "COPY":
            *sources, _dest = rest.split()
            copied += sources
    for source in copied:
        assert (ROOT / source).exists(), source
        assert not _docker_ignored(source, patterns), source
    assert {p.split("/")[0] for p in packages} | {"pyproject.toml", "README.md"} <= set(copied)


def _package_dirs() -> dict[str, str]:
    """Each installed package and the folder of the repository it is installed from (``pyproject.toml``)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(setuptools["packages"]) == set(setuptools["package-dir"]), "every package names its folder"
    return dict(setuptools["package-dir"])


def test_every_package_folder_is_installed_under_gnnstream() -> None:
    """A sub-package (a folder with ``__init__.py``) left out of pyproject.toml would be missing from the wheel."""
    folders = set(_package_dirs().values())
    found = {init.parent.relative_to(ROOT).as_posix() for top in folders if "/" not in top
             for init in (ROOT / top).rglob("__init__.py") if "__pycache__" not in init.parts}
    assert found == folders


def _build_context(dest: Path) -> list[str]:
    """Copy what the Dockerfile's COPY lines take from the build context into ``dest``; return the sources."""
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.strip().startswith("#")]
    sources = []
    for word, rest in _dockerfile_instructions():
        if word == "COPY":
            *srcs, _dest = rest.split()
            sources += srcs
    for source in sources:
        src = ROOT / source
        files = [src] if src.is_file() else [p for p in src.rglob("*") if p.is_file()]
        for path in files:
            rel = path.relative_to(ROOT).as_posix()
            if not _docker_ignored(rel, patterns):
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                (dest / rel).write_bytes(path.read_bytes())
    return sources


def test_image_build_steps_work_on_the_build_context(tmp_path: Path) -> None:
    """The Dockerfile's requirements step and `pip install .` work on exactly the files the image gets."""
    context = tmp_path / "context"
    context.mkdir()
    _build_context(context)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    # the requirements one-liner, as written in the Dockerfile
    step = next(rest for word, rest in _dockerfile_instructions() if word == "RUN" and "tomllib" in rest)
    command = step.split(" > /tmp/requirements.txt")[0]
    assert command.startswith("python -c ")
    result = subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True, timeout=60, cwd=context,
                            env=env)
    assert result.returncode == 0, result.stderr
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert result.stdout.split() == pyproject["project"]["dependencies"]
    # the package builds from the context alone, with every module and the console script
    wheels = tmp_path / "wheels"
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                             "-w", str(wheels), str(context)], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = wheels.glob("gnnstream-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(zf.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    for package, folder in _package_dirs().items():
        for module in (ROOT / folder).glob("*.py"):
            installed = f"{package.replace('.', '/')}/{module.name}"
            assert installed in names, f"{module} is missing from the image's install (as {installed})"
    # one top-level package, gnnstream, and its metadata: no generic names in site-packages
    assert {n.split("/")[0] for n in names} == {"gnnstream", "gnnstream-0.1.0.dist-info"}
    assert "gnnstream = gnnstream.workers.cli:main" in entry_points
    assert "fraud = gnnstream.fraud.cli:add_commands" in entry_points
    assert wheel.name.endswith("-py3-none-any.whl"), f"{wheel.name}: the package must be pure Python"
    assert not [n for n in names if n.endswith((".so", ".c", ".pyd"))], "compiled code in the wheel"


# ---------------------------------------------------------------------- the install script and the docs
def test_install_promtool_never_downloads() -> None:
    script = INSTALL_PROMTOOL.read_text()
    assert script.startswith("#!/usr/bin/env bash\n")
    assert os.access(INSTALL_PROMTOOL, os.X_OK)
    for word in ("curl", "wget", "http://", "https://"):
        assert word not in script, f"install-promtool.sh must not download anything ({word})"
    assert "apt-get install" in script and "command -v promtool" in script


def test_install_promtool_fails_cleanly_without_root_or_apt(tmp_path: Path) -> None:
    # A PATH with only the basics and no promtool/apt-get: the script must exit 1 with a message.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("id", "printf", "chmod", "rm", "bash"):
        real = next((Path(d) / tool for d in ("/usr/bin", "/bin") if (Path(d) / tool).exists()), None)
        assert real is not None, tool
        (bin_dir / tool).symlink_to(real)
    bash = str(bin_dir / "bash")
    result = subprocess.run([bash, str(INSTALL_PROMTOOL)], capture_output=True, text=True, timeout=60,
                            env={"PATH": str(bin_dir)})
    assert result.returncode == 1
    assert result.stdout == ""
    assert "install-promtool:" in result.stderr


def test_docs_describe_the_stack(compose: dict[str, Any], workers: dict[str, Any],
                                 worker_envs: dict[str, dict[str, str]]) -> None:
    text = DOCS.read_text()
    assert "docker compose up --build" in text
    assert "gnnstream produce --bootstrap localhost:9092 --format snap" in text
    assert "http://localhost:3000" in text and "admin" in text
    assert "http://localhost:9090" in text
    # every worker: its service, worker id, state volume and host ports
    for name, worker in workers.items():
        assert f"`{name}`" in text, f"docs/deployment.md does not list the worker service {name}"
        assert f"`{worker_envs[name]['GNNSTREAM_WORKER_ID']}`" in text, name
        assert f"`{_mounts(worker)['/var/lib/gnnstream']}`" in text, name
        for host, container in _port_pairs(worker):
            assert re.search(rf"\b{host}\b", text), f"docs/deployment.md does not give {name}'s host port {host}"
            if container == int(worker_envs[name]["GNNSTREAM_METRICS_PORT"]):
                assert f"http://localhost:{host}/metrics" in text, name
    assert "--scale" in text, "say why `docker compose up --scale` is no way to add workers"
    # the model's version topic and group, as the worker derives them from the model model-init creates
    from gnnstream.stream.rollout import version_topic
    init = _model_init_script(compose["services"])
    tag = "{}:{}".format(re.search(r"--name (\S+)", init).group(1), re.search(r"--version (\S+)", init).group(1))
    group = version_topic(tag, worker_envs[next(iter(workers))]["GNNSTREAM_GROUP"])
    assert set(re.findall(r"node-embeddings\.[\w.-]+\.v\d+", text)) == {version_topic(tag)}, tag
    assert f"`{group}`" in text and f"`{tag}`" in text, (group, tag)
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        assert panel["title"] in text, f"docs/deployment.md does not list the panel {panel['title']!r}"
    for alert in _yaml(RULES)["groups"][0]["rules"]:
        assert alert["alert"] in text
