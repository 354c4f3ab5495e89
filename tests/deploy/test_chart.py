"""The Helm chart (deploy/helm/appliance), rendered by Helm itself: the committed
manifests are what it renders, every object validates against the Kubernetes schemas,
and the autoscaler's queries name metrics a live server really exposes.

No cluster runs here: docs/deployment.md says what a k3s site runs on top of this."""

from __future__ import annotations

import copy
import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from devtools import helm_render

helm_python = pytest.importorskip("helm_python", reason="the test extra brings helm-python-sdk")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

K8S_VERSION = "1.30"  # what k3s and kubeadm clusters run today; the chart needs >= 1.25
HERE = Path(__file__).parent
EXAMPLES = sorted(p.stem for p in helm_render.EXAMPLES.glob("*.yaml"))


def _objects(values: dict[str, Any]) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(helm_render.render(values)) if d]


def _by_kind(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in objects}


def _example(name: str) -> dict[str, Any]:
    return yaml.safe_load((helm_render.EXAMPLES / f"{name}.yaml").read_text()) or {}


def _validate(obj: dict[str, Any]) -> None:
    if obj["kind"] == "ServiceMonitor":  # a CRD: the operator's schema, not the core's
        schema = json.loads((HERE / "servicemonitor.schema.json").read_text())
        jsonschema.validate(obj, schema)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_committed_manifests_are_what_the_chart_renders() -> None:
    assert EXAMPLES == ["jetson-daemonset-ota", "x86", "x86-gpu"]
    assert helm_render.main(["--check"]) == 0, "run: python -m devtools.helm_render"


def test_helm_lints_the_chart() -> None:
    result = helm_python.lint(str(helm_render.CHART))
    assert result["errors"] == []
    assert not [m for m in result["messages"] if m["severity"] > 1], result["messages"]


@pytest.mark.parametrize("example", EXAMPLES)
def test_every_object_validates_against_the_kubernetes_schemas(example: str) -> None:
    objects = _objects(_example(example))
    assert objects
    for obj in objects:
        _validate(obj)


@pytest.mark.parametrize(
    "values",
    [
        {"kind": "DaemonSet", "modelRepository": {"source": "hostPath"}},
        {"ota": {"enabled": True},
         "server": {"adminToken": "t", "config": {"max_queued_bytes": "64MiB"}}},
        {"modelRepository": {"existingClaim": "models"}, "autoscaling": {"enabled": False},
         "serviceMonitor": {"enabled": False}, "prometheusAnnotations": False, "replicas": 2},
        {"platform": "jetson", "jetson": {"powerModeFiles": False}, "cpu": {"limit": "2"}},
    ],
)  # fmt: skip
def test_other_value_sets_validate_too(values: dict[str, Any]) -> None:
    objects = _objects(values)
    for obj in objects:
        _validate(obj)
    config = yaml.safe_load(_by_kind(objects)["Secret"]["stringData"]["appliance.yaml"])
    assert config["memory_limit"] == "1024MiB"


def test_the_validation_can_fail() -> None:
    deployment = _by_kind(_objects({}))["Deployment"]
    wrong = copy.deepcopy(deployment)
    wrong["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["port"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(wrong)
    typo = copy.deepcopy(deployment)
    typo["spec"]["replica"] = 2  # strict: unknown fields are refused
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(typo)
    monitor = _by_kind(_objects({}))["ServiceMonitor"]
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(jsonschema.ValidationError):
        _validate(monitor)


def _server(objects: list[dict[str, Any]]) -> dict[str, Any]:
    workload = next(o for o in objects if o["kind"] in ("Deployment", "DaemonSet"))
    spec = workload["spec"]["template"]["spec"]
    return {"workload": workload, "pod": spec, "main": spec["containers"][0]}


def test_the_default_site_follows_tritons_conventions() -> None:
    objects = _objects({})
    kinds = _by_kind(objects)
    s = _server(objects)
    main = s["main"]
    assert s["workload"]["kind"] == "Deployment"
    assert main["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert main["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert main["startupProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert main["startupProbe"]["failureThreshold"] * main["startupProbe"]["periodSeconds"] == 300
    assert [p["containerPort"] for p in main["ports"]] == [8000, 8001, 8002]
    annotations = s["workload"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "8002"
    assert annotations["prometheus.io/path"] == "/metrics"
    # resources tied to memory_limit: the container holds the budget plus the server
    config = yaml.safe_load(kinds["Secret"]["stringData"]["appliance.yaml"])
    assert config["memory_limit"] == "1024MiB" and config["host"] == "0.0.0.0"
    assert main["resources"]["limits"]["memory"] == "1280Mi"
    assert main["resources"]["requests"]["memory"] == "1280Mi"
    assert s["pod"]["volumes"][2]["persistentVolumeClaim"]["claimName"] == "site-appliance-models"
    assert kinds["PersistentVolumeClaim"]["metadata"]["name"] == "site-appliance-models"
    assert "nvidia.com/gpu" not in main["resources"]["limits"]
    assert "runtimeClassName" not in s["pod"]
    # the ServiceMonitor selects the Service and scrapes its metrics port
    monitor, service = kinds["ServiceMonitor"], kinds["Service"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in [p["name"] for p in service["spec"]["ports"]]
    hpa = kinds["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == s["workload"]["metadata"]["name"]
    assert "replicas" not in s["workload"]["spec"]  # the HPA owns the count


def test_gpu_jetson_daemonset_and_ota() -> None:
    gpu = _server(_objects(_example("x86-gpu")))
    assert gpu["main"]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gpu["pod"]["nodeSelector"]["kubernetes.io/arch"] == "amd64"
    objects = _objects(_example("jetson-daemonset-ota"))
    kinds = _by_kind(objects)
    jetson = _server(objects)
    assert jetson["workload"]["kind"] == "DaemonSet"
    assert jetson["pod"]["runtimeClassName"] == "nvidia"
    assert jetson["pod"]["nodeSelector"]["kubernetes.io/arch"] == "arm64"
    assert "HorizontalPodAutoscaler" not in kinds  # one pod per node: nothing to scale
    containers = {c["name"]: c for c in jetson["pod"]["containers"]}
    assert containers["ota-agent"]["args"] == [
        "ota", "agent", "--config", "/etc/appliance/appliance.yaml",
    ]  # fmt: skip
    (init,) = jetson["pod"]["initContainers"]
    assert "appliance ota agent --once" in init["args"][0]
    models = next(v for v in jetson["pod"]["volumes"] if v["name"] == "models")
    assert "emptyDir" in models
    config = yaml.safe_load(kinds["Secret"]["stringData"]["appliance.yaml"])
    assert config["ota"]["server"] == "http://127.0.0.1:8000" and config["admin_token"]
    assert config["ota"]["state_dir"] == "/var/lib/appliance/ota"
    mounts = {m["mountPath"] for m in containers["appliance"]["volumeMounts"]}
    assert {"/var/lib/nvpmodel", "/etc/nvpmodel.conf"} <= mounts
    hostpath = _server(_objects({"kind": "DaemonSet", "modelRepository": {"source": "hostPath"}}))
    models = next(v for v in hostpath["pod"]["volumes"] if v["name"] == "models")
    assert models["hostPath"]["path"] == "/var/lib/appliance/models"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"kind": "StatefulSet"}, "kind: Deployment or DaemonSet"),
        ({"ota": {"enabled": True}}, "ota.enabled needs server.adminToken"),
        ({"modelRepository": {"source": "ota"}}, "needs ota.enabled"),
        ({"platform": "jetson", "gpu": {"count": 1}}, "gpu.count is for discrete GPUs"),
    ],
)
def test_bad_values_fail_the_render(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmError, match=re.escape(message)):
        helm_render.render(values)


def _adapter_rule(objects: list[dict[str, Any]]) -> dict[str, Any]:
    rules = next(o for o in objects if o["metadata"]["name"].endswith("-adapter-rules"))
    (rule,) = yaml.safe_load(rules["data"]["config.yaml"])["rules"]
    return rule


def test_the_adapter_rule_is_written_as_tritons_chart_writes_it() -> None:
    objects = _objects({})
    rule = _adapter_rule(objects)
    # Triton's deploy/k8s-onprem/values.yaml, prometheus-adapter.rules.custom
    assert rule == {
        "seriesQuery": 'nv_inference_queue_duration_us{namespace="edge",pod!=""}',
        "resources": {"overrides": {"namespace": {"resource": "namespace"},
                                    "pod": {"resource": "pod"}}},
        "name": {"matches": "nv_inference_queue_duration_us", "as": "avg_time_queue_us"},
        "metricsQuery": "avg(delta(nv_inference_queue_duration_us{<<.LabelMatchers>>}[30s])"
                        "/(1+delta(nv_inference_request_success{<<.LabelMatchers>>}[30s])))"
                        " by (<<.GroupBy>>)",
    }  # fmt: skip
    hpa = _by_kind(objects)["HorizontalPodAutoscaler"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "50"}


def test_the_autoscaler_queries_name_metrics_a_live_server_exposes(run_appliance) -> None:
    rule = _adapter_rule(_objects({}))
    queried = set(re.findall(r"\bnv_\w+", rule["seriesQuery"] + rule["metricsQuery"]))
    assert queried == {"nv_inference_queue_duration_us", "nv_inference_request_success"}
    srv = run_appliance()
    page = urllib.request.urlopen(srv.metrics_url, timeout=10).read().decode()
    exposed = {line.split("{")[0].split(" ")[0] for line in page.splitlines() if line[:1] != "#"}
    assert queried <= exposed
    # per pod and model, as the adapter's delta() needs: counters, not per-scrape gauges
    assert "# TYPE nv_inference_queue_duration_us untyped" in page


@pytest.mark.parametrize("example", EXAMPLES)
def test_the_rendered_config_is_one_the_server_and_agent_accept(example: str, tmp_path) -> None:
    from appliance.config.server_config import load_server_config

    secret = _by_kind(_objects(_example(example)))["Secret"]
    config = yaml.safe_load(secret["stringData"]["appliance.yaml"])
    (tmp_path / "models").mkdir()
    config["model_repository"] = str(tmp_path / "models")  # /models in the pod
    if "ota" in config:
        root = tmp_path / "root.json"
        root.write_text("{}")
        config["ota"] |= {"trusted_root": str(root), "state_dir": str(tmp_path / "state")}
    path = tmp_path / "appliance.yaml"
    path.write_text(yaml.safe_dump(config))
    server = load_server_config(path, {})
    assert server.memory_limit == _example(example).get("memory", {}).get("modelsMiB", 1024) * 2**20
    assert server.host == "0.0.0.0" and server.metrics_port == 8002
    if "ota" in config:
        from appliance.ota.config import load

        agent = load(path)
        assert agent.server == "http://127.0.0.1:8000"
