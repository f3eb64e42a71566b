"""The Helm chart (deploy/helm/raylane), offline: `helm lint` and renders through Helm's own Go
library (`helm-python-sdk`), every rendered core object checked by `kubernetes-validate
--strict`, the RayService by the KubeRay CRD schema (../shared/kuberay), the Serve config by
importing its import path and loading its arguments into `ClusterConfig`; bad values refused
with a readable message; no secret value (a DSN included) outside a Secret.
"""

from __future__ import annotations

import copy
import functools
import importlib
import os
from pathlib import Path

import pytest
import yaml
from raylane.actors.engine.spec import SpeculativeConfig

helm = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "raylane"
EXAMPLES = ROOT / "deploy" / "helm" / "examples"
CRD = ROOT.parent / "shared" / "kuberay" / "ray.io_rayservices.yaml"
KUBE_VERSION = "1.33.0"
CORE_KINDS = {"Secret", "Service", "PersistentVolumeClaim", "StatefulSet"}


def example(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())


@functools.lru_cache(maxsize=1)
def chart():
    return helm.Chart.load(str(CHART))


def render(values: dict | None = None) -> list[dict]:
    """Every object the chart renders with `values` (on top of its defaults)."""
    out = chart().render(values or {}, name="rl", namespace="ml", is_install=True)
    docs = []
    for path, text in out.items():
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def only(docs: list[dict], kind: str) -> dict:
    (doc,) = by_kind(docs, kind)
    return doc


@functools.lru_cache(maxsize=1)
def rayservice_schema() -> dict:
    if not CRD.exists():
        pytest.skip(f"the KubeRay CRD is not at {CRD} (shared/ beside the checkout)")
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


CONFIGS = {
    "defaults": {},
    "cpu-dev": example("cpu-dev"),
    "gpu-tp4": example("gpu-tp4"),
    "metrics-with-literal-key": {
        "metrics": {"serviceMonitor": {"enabled": True}},
        "auth": {"apiKey": {"value": "k"}},
    },
    "llama3-tools-serial": {
        "serving": {"toolCallParser": "llama3", "asyncScheduling": False, "trainerApi": True}
    },
    "batch-invariant": {"serving": {"batchInvariant": True}},
    "speculative": {
        "serving": {"speculativeConfig": {"method": "suffix", "num_speculative_tokens": 3}}
    },
    "sessions-and-consolidation": {
        "postgres": {"dsn": {"value": "", "secretKeyRef": {"name": "db", "key": "dsn"}}},
        "sessions": {"persist": True},
        "consolidation": {
            "enabled": True,
            "banks": ["bank-a", "bank-b"],
            "intervalSeconds": 0.5,
            "batchSize": 10,
            "llmBatchSize": 2,
            "maxParallelGroups": 3,
            "maxTokens": 256,
            "model": "judge",
        },
    },
}


def container_env(docs: list[dict]) -> list[dict[str, dict]]:
    """Each Ray container's env (head, then workers), by variable name."""
    cluster = only(docs, "RayService")["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [
        {e["name"]: e for e in c["env"]} for p in pods for c in p["template"]["spec"]["containers"]
    ]


def test_lint_is_clean():
    report = helm.lint(str(CHART), strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


@pytest.mark.parametrize("name", CONFIGS)
def test_lint_is_clean_with_each_config(name):
    report = helm.lint(str(CHART), CONFIGS[name], strict=True)
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2]


@pytest.mark.parametrize("name", CONFIGS)
def test_core_objects_pass_kubernetes_validate_strict(name):
    docs = render(CONFIGS[name])
    core = [d for d in docs if d["kind"] in CORE_KINDS]
    assert core
    for doc in core:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("name", CONFIGS)
def test_rayservice_matches_the_kuberay_crd(name):
    import jsonschema

    service = only(render(CONFIGS[name]), "RayService")
    jsonschema.validate(service, rayservice_schema())
    # and the validator bites: a field the CRD does not know
    broken = copy.deepcopy(service)
    broken["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"] = ["not", "a", "map"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, rayservice_schema())


@pytest.mark.parametrize("name", CONFIGS)
def test_serve_config_imports_and_its_args_load(name, monkeypatch):
    from raylane.config import ClusterConfig

    for key in ("RAYLANE_CONFIG", "RAYLANE_MODEL", "RAYLANE_REPLICAS", "RAYLANE_PORT"):
        monkeypatch.delenv(key, raising=False)
    # what the pods get from the Secret (the args never hold it)
    monkeypatch.setenv("RAYLANE_CONSOLIDATION_DSN", "postgresql://u@db/memories")
    values = CONFIGS[name]
    serve = yaml.safe_load(only(render(values), "RayService")["spec"]["serveConfigV2"])
    (app,) = serve["applications"]
    module, attr = app["import_path"].split(":")
    assert callable(getattr(importlib.import_module(module), attr))
    config = ClusterConfig.from_dict(app["args"])
    serving = values.get("serving", {})
    assert config.replicas == serving.get("replicas", 1)
    assert config.engine["tensor_parallel_size"] == serving.get("tensorParallelSize", 1)
    assert config.model == (values.get("model", {}).get("path") or None)
    assert not config.api_keys and config.admin_api_key is None  # keys never in the config
    assert config.engine["async_scheduling"] == serving.get("asyncScheduling", True)
    assert config.engine_config("/m").batch_invariant is serving.get("batchInvariant", False)
    spec = serving.get("speculativeConfig")
    assert config.engine.get("speculative_config") == spec
    assert config.engine_config("/m").speculative_config == (
        SpeculativeConfig(**spec) if spec else None
    )
    assert config.tool_call_parser == (serving.get("toolCallParser") or None)
    assert config.trainer_api == serving.get("trainerApi", False)
    assert config.sessions_dsn is None  # from RAYLANE_SESSIONS_DSN in the pods only
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["consolidation"]
    section = {**defaults, **values.get("consolidation", {})}
    if not section["enabled"]:
        assert config.consolidation is None
        return
    assert "dsn" not in app["args"]["consolidation"]
    service = config.consolidation_config()
    assert (service.banks, service.interval_s, service.model, service.max_tokens) == (
        tuple(section["banks"]) or None,
        section["intervalSeconds"],
        section["model"] or None,
        section["maxTokens"],
    )
    assert (
        service.limits.batch_size,
        service.limits.llm_batch_size,
        service.limits.max_parallel_groups,
    ) == (section["batchSize"], section["llmBatchSize"], section["maxParallelGroups"])


def test_consolidation_defaults_consolidate_every_bank_with_the_served_model():
    values = {"postgres": {"inChart": {"enabled": True}}, "consolidation": {"enabled": True}}
    serve = yaml.safe_load(only(render(values), "RayService")["spec"]["serveConfigV2"])
    (app,) = serve["applications"]
    assert app["args"]["consolidation"] == {
        "interval_s": 60,
        "batch_size": 50,
        "llm_batch_size": 8,
        "max_parallel_groups": 4,
        "max_tokens": 1024,
    }


@pytest.mark.parametrize(
    ("values", "ref"),
    [
        (
            {"postgres": {"dsn": {"value": "", "secretKeyRef": {"name": "db", "key": "dsn"}}}},
            {"name": "db", "key": "dsn"},
        ),
        (
            {"postgres": {"inChart": {"enabled": True}}},
            {"name": "rl-raylane-secrets", "key": "postgres-dsn"},
        ),
        (
            {
                "postgres": {"inChart": {"enabled": True}},  # its own database wins
                "sessions": {"dsn": {"value": "", "secretKeyRef": {"name": "s", "key": "k1"}}},
                "consolidation": {"dsn": {"value": "", "secretKeyRef": {"name": "c", "key": "k2"}}},
            },
            None,
        ),
    ],
)
def test_each_dsn_reaches_every_ray_pod_from_a_secret(values, ref):
    values = {
        **values,
        "sessions": {"persist": True, **values.get("sessions", {})},
        "consolidation": {"enabled": True, **values.get("consolidation", {})},
    }
    for env in container_env(render(values)):
        sessions = env["RAYLANE_SESSIONS_DSN"]["valueFrom"]["secretKeyRef"]
        consolidation = env["RAYLANE_CONSOLIDATION_DSN"]["valueFrom"]["secretKeyRef"]
        if ref is None:
            assert (sessions, consolidation) == (
                {"name": "s", "key": "k1"},
                {"name": "c", "key": "k2"},
            )
        else:
            assert sessions == consolidation == ref
        assert not [e for e in env.values() if e["name"].endswith("_DSN") and "value" in e]


def test_without_sessions_or_consolidation_no_pod_gets_a_dsn():
    values = {"postgres": {"dsn": {"value": "", "secretKeyRef": {"name": "db", "key": "dsn"}}}}
    for env in container_env(render(values)):
        assert not [name for name in env if name.endswith("_DSN")]


def test_gpu_tp4_workers_shm_and_head():
    docs = render(CONFIGS["gpu-tp4"])
    cluster = only(docs, "RayService")["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    (group,) = cluster["workerGroupSpecs"]
    pod = group["template"]["spec"]
    (container,) = pod["containers"]
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 4
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    env = {e["name"]: e for e in container["env"]}
    assert env["RAYLANE_SESSIONS_DSN"]["valueFrom"]["secretKeyRef"] == {
        "name": "raylane-db",
        "key": "dsn",
    }
    assert env["RAYLANE_CONSOLIDATION_DSN"]["valueFrom"]["secretKeyRef"] == {
        "name": "raylane-memories",
        "key": "dsn",
    }
    assert env["RAYLANE_ADMIN_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "raylane-keys"
    monitor = only(docs, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["bearerTokenSecret"] == {
        "name": "raylane-keys",
        "key": "api-key",
    }
    assert not by_kind(docs, "Secret")  # nothing literal: the chart makes no Secret


def test_tp1_has_no_shm_volume_and_probes_wait_for_slow_loads():
    cluster = only(render(), "RayService")["spec"]["rayClusterConfig"]
    pod = cluster["workerGroupSpecs"][0]["template"]["spec"]
    assert all(v["name"] != "dshm" for v in pod["volumes"])
    (head,) = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    startup = head["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60


def test_cpu_dev_runs_postgres_in_the_chart_and_points_the_dsn_at_it():
    docs = render(CONFIGS["cpu-dev"])
    stateful = only(docs, "StatefulSet")
    assert stateful["metadata"]["name"] == "rl-raylane-postgres"
    secret = only(docs, "Secret")
    assert "@rl-raylane-postgres:5432/raylane" in secret["stringData"]["postgres-dsn"]
    (head,) = only(docs, "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]["template"][
        "spec"
    ]["containers"]
    env = {e["name"]: e for e in head["env"]}
    for name in ("RAYLANE_SESSIONS_DSN", "RAYLANE_CONSOLIDATION_DSN"):
        assert env[name]["valueFrom"]["secretKeyRef"] == {
            "name": "rl-raylane-secrets",
            "key": "postgres-dsn",
        }


def test_pods_run_hardened():
    docs = render(CONFIGS["cpu-dev"])
    cluster = only(docs, "RayService")["spec"]["rayClusterConfig"]
    pods = [
        cluster["headGroupSpec"]["template"]["spec"],
        cluster["workerGroupSpecs"][0]["template"]["spec"],
        only(docs, "StatefulSet")["spec"]["template"]["spec"],
    ]
    for pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"]
            assert context["readOnlyRootFilesystem"] is True


def test_the_service_reaches_only_the_ray_pods():
    docs = render(CONFIGS["cpu-dev"])
    service = next(d for d in by_kind(docs, "Service") if d["metadata"]["name"] == "rl-raylane")
    selector = service["spec"]["selector"]
    cluster = only(docs, "RayService")["spec"]["rayClusterConfig"]
    ray_pods = [cluster["headGroupSpec"]["template"], cluster["workerGroupSpecs"][0]["template"]]
    postgres = only(docs, "StatefulSet")["spec"]["template"]
    matches = [
        all(t["metadata"]["labels"].get(k) == v for k, v in selector.items())
        for t in [*ray_pods, postgres]
    ]
    assert matches == [True, True, False]


SENTINELS = {
    ("auth", "apiKey"): "sentinel-api-4a1b",
    ("auth", "adminKey"): "sentinel-adm-9c2d",
    ("postgres", "dsn"): "postgresql://u:sentinel-pw-77@db/x",
    ("sessions", "dsn"): "postgresql://u:sentinel-pw-81@sessions/x",
    ("consolidation", "dsn"): "postgresql://u:sentinel-pw-93@memories/x",
    ("hub", "token"): "sentinel-hub-5e6f",
}


def test_no_secret_value_outside_a_secret():
    values: dict = {
        "postgres": {"inChart": {"enabled": True, "password": {"value": "sentinel-pg-3b8a"}}},
        "metrics": {"serviceMonitor": {"enabled": True}},
        "sessions": {"persist": True},
        "consolidation": {"enabled": True},
    }
    for (group, name), secret in SENTINELS.items():
        values.setdefault(group, {})[name] = {"value": secret}
    docs = render(values)
    secrets = [*SENTINELS.values(), "sentinel-pg-3b8a"]
    (stored,) = by_kind(docs, "Secret")
    assert set(secrets) <= set(stored["stringData"].values())
    for doc in docs:
        if doc["kind"] != "Secret":
            text = yaml.safe_dump(doc)
            assert not [s for s in secrets if s in text], doc["kind"]
    notes = chart().render(values, name="rl", namespace="ml")["raylane/templates/NOTES.txt"]
    assert not [s for s in secrets if s in notes]


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"serving": {"replica": 2}}, "replica"),  # misspelled
        ({"servng": {}}, "servng"),
        ({"serving": {"tensorParallelSize": 0}}, "tensorParallelSize"),
        ({"serving": {"toolCallParser": "mistral"}}, "toolCallParser"),
        ({"model": {"dtype": "fp8"}}, "dtype"),
        ({"serving": {"batchInvariant": "yes"}}, "batchInvariant"),
        (
            {"serving": {"batchInvariant": True}, "workers": {"gpusPerWorker": 1}},
            "serving.batchInvariant runs on CPU workers only",
        ),
        ({"service": {"port": 70000}}, "port"),
        (
            {"serving": {"tensorParallelSize": 4}, "workers": {"gpusPerWorker": 2}},
            "gpusPerWorker (2) is less than serving.tensorParallelSize (4)",
        ),
        (
            {
                "serving": {"replicas": 3, "tensorParallelSize": 2},
                "workers": {"gpusPerWorker": 2, "replicas": 2, "maxReplicas": 2},
            },
            "at most 4",
        ),
        ({"serving": {"tensorParallelSize": 2}, "workers": {"gpusPerWorker": 3}}, "multiple"),
        ({"auth": {"apiKey": {"value": "same"}, "adminKey": {"value": "same"}}}, "differ"),
        (
            {"auth": {"apiKey": {"value": "a", "secretKeyRef": {"name": "s", "key": "k"}}}},
            "not both",
        ),
        (
            {"consolidation": {"dsn": {"value": "a", "secretKeyRef": {"name": "s", "key": "k"}}}},
            "consolidation.dsn: set either value or secretKeyRef, not both",
        ),
        ({"sessions": {"persist": True}}, "sessions.persist needs a PostgreSQL"),
        ({"consolidation": {"enabled": True}}, "consolidation.enabled needs a PostgreSQL"),
        ({"consolidation": {"intervalSeconds": 0}}, "intervalSeconds"),
        ({"consolidation": {"llmBatchSize": 0}}, "llmBatchSize"),
        ({"consolidation": {"banks": "all"}}, "banks"),
        ({"sessions": {"dsn": "postgresql://u:pw@db/x"}}, "dsn"),  # only as a secret
    ],
)
def test_bad_values_are_refused_with_a_readable_message(values, says):
    with pytest.raises(helm.HelmError) as caught:
        render(values)
    assert says in str(caught.value)


def test_the_dockerfile_pins_and_drops_root():
    text = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    assert "torch==2.13.0" in text and "ray[serve]==" in text
    base = next(line for line in text.splitlines() if line.startswith("FROM "))
    assert "cuda" in base and ":latest" not in base and base.count(":") == 1
    users = [line.split()[1] for line in text.splitlines() if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    assert os.path.basename(str(CHART)) == "raylane"
