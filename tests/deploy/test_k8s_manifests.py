"""deploy/k8s: manifests parse, match a small schema, and fit together (names, labels, ports)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pytest
from deploy_files import K8S, load_yaml, load_yaml_all, settings_env_names

MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
WORKLOADS = {"Deployment", "DaemonSet", "StatefulSet"}
NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", "maxLength": 253}

CONTAINER = {
    "type": "object",
    "required": ["name", "image", "command"],
    "properties": {
        "name": NAME,
        "image": {"type": "string", "pattern": r"^\S+:\S+$"},  # pinned tag, never implicit latest
        "command": {"type": "array", "minItems": 1, "items": {"type": "string"}},
        "env": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name"],
                "oneOf": [{"required": ["value"]}, {"required": ["valueFrom"]}],
            },
        },
        "envFrom": {"type": "array"},
        "ports": {
            "type": "array",
            "items": {"type": "object", "required": ["containerPort"]},
        },
    },
}

OBJECT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["apiVersion", "kind", "metadata"],
    "properties": {
        "apiVersion": {"type": "string", "minLength": 1},
        "kind": {"type": "string", "minLength": 1},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": NAME,
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
    },
    "allOf": [
        {
            "if": {"properties": {"kind": {"enum": sorted(WORKLOADS)}}},
            "then": {
                "required": ["spec"],
                "properties": {
                    "apiVersion": {"const": "apps/v1"},
                    "spec": {
                        "type": "object",
                        "required": ["selector", "template"],
                        "properties": {
                            "template": {
                                "type": "object",
                                "required": ["metadata", "spec"],
                                "properties": {
                                    "metadata": {"type": "object", "required": ["labels"]},
                                    "spec": {
                                        "type": "object",
                                        "required": ["containers"],
                                        "properties": {
                                            "containers": {"type": "array", "minItems": 1, "items": CONTAINER},
                                            "initContainers": {"type": "array", "items": CONTAINER},
                                        },
                                    },
                                },
                            }
                        },
                    },
                },
            },
        },
        {
            "if": {"properties": {"kind": {"const": "Service"}}},
            "then": {
                "required": ["spec"],
                "properties": {"spec": {"type": "object", "required": ["selector", "ports"]}},
            },
        },
        {
            "if": {"properties": {"kind": {"enum": ["ConfigMap", "Secret"]}}},
            "then": {"anyOf": [{"required": ["data"]}, {"required": ["stringData"]}]},
        },
    ],
}


def objects() -> list[dict[str, Any]]:
    return [doc for path in MANIFESTS for doc in load_yaml_all(path)]


def find(kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]


def container(obj: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod_spec(obj)["containers"] if c["name"] == name)


def test_manifests_exist() -> None:
    kinds = {o["kind"] for o in objects()}
    assert {"DaemonSet", "Deployment", "Service", "ConfigMap", "Secret"} <= kinds


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_matches_schema(path: Path) -> None:
    jsonschema.Draft202012Validator.check_schema(OBJECT_SCHEMA)
    validator = jsonschema.Draft202012Validator(OBJECT_SCHEMA)
    docs = load_yaml_all(path)
    assert docs, f"{path.name} is empty"
    for doc in docs:
        errors = sorted(validator.iter_errors(doc), key=lambda e: e.json_path)
        where = f"{path.name} {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        assert not errors, where + "\n" + "\n".join(f"{e.json_path}: {e.message}" for e in errors)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = load_yaml(K8S / "kustomization.yaml")
    assert sorted(kustomization["resources"]) == sorted(p.name for p in MANIFESTS)


def test_selectors_match_pod_labels() -> None:
    for obj in objects():
        if obj["kind"] in WORKLOADS:
            selector = obj["spec"]["selector"]["matchLabels"]
            labels = obj["spec"]["template"]["metadata"]["labels"]
            assert selector.items() <= labels.items(), f"{obj['kind']}/{obj['metadata']['name']}"


def test_agent_daemonset() -> None:
    ds = find("DaemonSet", "clusterpulse-agent")
    spec = pod_spec(ds)
    agent = container(ds, "agent")
    assert agent["command"] == ["pulse", "agent", "--node", "$(NODE_NAME)", "--source", "auto"]
    env = {e["name"]: e for e in agent["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert spec.get("runtimeClassName") == "nvidia"
    device_mounts = [m["mountPath"] for m in agent.get("volumeMounts", []) if m["mountPath"].startswith("/dev/")]
    privileged = agent.get("securityContext", {}).get("privileged") is True
    assert privileged or {"/dev/ipmi0"} <= set(device_mounts), "the agent needs /dev/ipmi0 and /dev/nvidia*"
    assert not spec.get("hostPID"), "hostPID is not needed"
    # The agent sees every GPU without requesting nvidia.com/gpu, which would take GPUs from jobs.
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert "nvidia.com/gpu" not in agent.get("resources", {}).get("limits", {})


def test_agent_gets_no_database_credentials() -> None:
    agent = container(find("DaemonSet", "clusterpulse-agent"), "agent")
    assert not any("secretRef" in ref for ref in agent.get("envFrom", [])), "only the token, via secretKeyRef"


def test_orchestrator_deployment() -> None:
    deploy = find("Deployment", "clusterpulse-orchestrator")
    orch = container(deploy, "orchestrator")
    assert orch["command"] == ["pulse", "orchestrator", "--host", "0.0.0.0", "--port", "8000"]
    ports = {p.get("name"): p["containerPort"] for p in orch["ports"]}
    assert 8000 in ports.values()
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = orch[probe]["httpGet"]
        assert get["path"] == path, probe
        assert get["port"] in (8000, *[n for n, p in ports.items() if p == 8000]), probe
    annotations = deploy["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "8000"
    assert annotations.get("prometheus.io/path", "/metrics") == "/metrics"
    init = [c["command"] for c in pod_spec(deploy).get("initContainers", [])]
    assert ["pulse", "db", "upgrade"] in init, "the schema is migrated before the orchestrator starts"


def test_orchestrator_service() -> None:
    svc = find("Service", "clusterpulse-orchestrator")
    pod_labels = find("Deployment", "clusterpulse-orchestrator")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert [p["port"] for p in svc["spec"]["ports"]] == [8000]
    assert svc["metadata"]["annotations"]["prometheus.io/scrape"] == "true"


def test_settings_objects() -> None:
    config = find("ConfigMap", "clusterpulse-config")
    secret = find("Secret", "clusterpulse-secrets")
    known = settings_env_names()
    for obj, values in ((config, config["data"]), (secret, secret["stringData"])):
        for key in values:
            assert key in known, f"{obj['kind']} key {key} is not a field of clusterpulse.settings.Settings"
    assert {"PULSE_API_TOKEN", "PULSE_DATABASE_URL"} <= set(secret["stringData"])
    assert secret["stringData"]["PULSE_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert "PULSE_REDIS_URL" in config["data"] or "PULSE_REDIS_URL" in secret["stringData"]


def test_references_resolve() -> None:
    """Every ConfigMap and Secret a pod refers to is defined, in the same namespace."""
    defined = {(o["kind"], o["metadata"]["name"], o["metadata"].get("namespace")) for o in objects()}
    for obj in objects():
        if obj["kind"] not in WORKLOADS:
            continue
        ns = obj["metadata"].get("namespace")
        spec = pod_spec(obj)
        for c in [*spec["containers"], *spec.get("initContainers", [])]:
            refs = [("ConfigMap", r["configMapRef"]["name"]) for r in c.get("envFrom", []) if "configMapRef" in r]
            refs += [("Secret", r["secretRef"]["name"]) for r in c.get("envFrom", []) if "secretRef" in r]
            for e in c.get("env", []):
                source = e.get("valueFrom", {})
                if "secretKeyRef" in source:
                    refs.append(("Secret", source["secretKeyRef"]["name"]))
                if "configMapKeyRef" in source:
                    refs.append(("ConfigMap", source["configMapKeyRef"]["name"]))
            for kind, name in refs:
                assert (kind, name, ns) in defined, f"{obj['metadata']['name']}/{c['name']}: {kind}/{name}"
