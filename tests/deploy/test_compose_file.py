"""docker-compose.yml and deploy/docker/Dockerfile, validated without Docker.

A small JSON schema covers what the stack depends on (not the whole Compose specification);
the rest are assertions on the parts that other files rely on.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from typing import Any

import jsonschema
import pytest
from deploy_files import COMPOSE_FILE, DOCKERFILE, REPO, load_yaml, settings_env_names

SERVICES = ("redis", "postgres", "orchestrator", "agents", "prometheus", "alertmanager", "grafana")

HEALTHCHECK = {
    "type": "object",
    "required": ["test"],
    "properties": {
        "test": {
            "oneOf": [
                {"type": "string", "minLength": 1},
                {
                    "type": "array",
                    "minItems": 2,
                    "items": {"type": "string"},
                    "prefixItems": [{"enum": ["CMD", "CMD-SHELL", "NONE"]}],
                },
            ]
        },
        "interval": {"type": "string", "pattern": r"^\d+(ms|s|m|h)$"},
        "timeout": {"type": "string", "pattern": r"^\d+(ms|s|m|h)$"},
        "start_period": {"type": "string", "pattern": r"^\d+(ms|s|m|h)$"},
        "retries": {"type": "integer", "minimum": 1},
    },
    "additionalProperties": False,
}

SERVICE = {
    "type": "object",
    "anyOf": [{"required": ["image"]}, {"required": ["build"]}],
    "properties": {
        "image": {"type": "string", "minLength": 1},
        "build": {
            "type": "object",
            "required": ["context", "dockerfile"],
            "properties": {"context": {"type": "string"}, "dockerfile": {"type": "string"}},
        },
        "command": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "environment": {
            "type": "object",
            "additionalProperties": {"type": ["string", "number", "boolean"]},
        },
        "ports": {"type": "array", "items": {"type": "string", "pattern": r"^\d+:\d+$"}},
        "volumes": {"type": "array", "items": {"type": "string", "pattern": r"^[^:]+:/[^:]*(:ro|:rw)?$"}},
        "depends_on": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "required": ["condition"],
                "properties": {
                    "condition": {"enum": ["service_started", "service_healthy", "service_completed_successfully"]}
                },
            },
        },
        "healthcheck": HEALTHCHECK,
        "restart": {"enum": ["no", "always", "on-failure", "unless-stopped"]},
    },
}

COMPOSE_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["services"],
    "properties": {
        "services": {
            "type": "object",
            "required": list(SERVICES),
            "additionalProperties": SERVICE,
            "properties": {"orchestrator": {"allOf": [SERVICE, {"required": ["build", "healthcheck", "command"]}]}},
        },
        "volumes": {"type": "object"},
    },
}


def compose() -> dict[str, Any]:
    return load_yaml(COMPOSE_FILE)


def service(name: str) -> dict[str, Any]:
    return compose()["services"][name]


def command_line(svc: dict[str, Any]) -> str:
    cmd = svc["command"]
    return cmd if isinstance(cmd, str) else shlex.join(cmd)


def test_compose_matches_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(COMPOSE_SCHEMA)
    errors = sorted(jsonschema.Draft202012Validator(COMPOSE_SCHEMA).iter_errors(compose()), key=lambda e: e.json_path)
    assert not errors, "\n".join(f"{e.json_path}: {e.message}" for e in errors)


def test_every_service_has_a_healthcheck() -> None:
    for name in SERVICES:
        assert "healthcheck" in service(name), f"{name}: healthcheck"


def test_orchestrator_service() -> None:
    svc = service("orchestrator")
    assert (REPO / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve() == DOCKERFILE.resolve()
    cmd = command_line(svc)
    assert re.search(r"pulse db upgrade && (exec )?pulse orchestrator --host 0\.0\.0\.0 --port 8000\b", cmd), cmd
    env = svc["environment"]
    assert env["PULSE_REDIS_URL"].startswith("redis://redis:")
    assert env["PULSE_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert "@postgres:5432/" in env["PULSE_DATABASE_URL"]
    assert env["PULSE_API_TOKEN"]
    test = " ".join(svc["healthcheck"]["test"]) if isinstance(svc["healthcheck"]["test"], list) else ""
    assert "/healthz" in test and ":8000" in test, test
    assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
    assert svc["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_simulated_agents() -> None:
    svc = service("agents")
    assert command_line(svc) == "pulse simulate --nodes 8 --gpus-per-node 8 --interval 5"
    assert svc["environment"]["PULSE_REDIS_URL"] == service("orchestrator")["environment"]["PULSE_REDIS_URL"]
    assert svc.get("image") == service("orchestrator").get("image"), "agents run the orchestrator's image"


def test_pulse_variables_are_settings() -> None:
    known = settings_env_names()
    for name, svc in compose()["services"].items():
        for key in svc.get("environment", {}):
            if key.startswith("PULSE_"):
                assert key in known, f"{name}: {key} is not a field of clusterpulse.settings.Settings"


@pytest.mark.parametrize(
    ("name", "target"),
    [
        ("prometheus", "/etc/prometheus"),
        ("alertmanager", "/etc/alertmanager"),
        ("grafana", "/etc/grafana/provisioning"),
    ],
)
def test_configuration_is_mounted(name: str, target: str) -> None:
    targets = [v.split(":")[1] for v in service(name)["volumes"]]
    assert target in targets, f"{name}: nothing mounted at {target}"


def test_bind_mount_sources_exist() -> None:
    for name, svc in compose()["services"].items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (REPO / source).exists(), f"{name}: {source} does not exist"
            else:
                assert source in compose().get("volumes", {}), f"{name}: named volume {source} undeclared"


def test_config_files_name_the_compose_commands() -> None:
    prom = " ".join(service("prometheus")["command"])
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom
    am = " ".join(service("alertmanager")["command"])
    assert "--config.file=/etc/alertmanager/alertmanager.yml" in am


# ---- Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text(encoding="utf-8").replace("\\\n", " ")
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def test_dockerfile_base_and_install() -> None:
    instructions = dockerfile_instructions()
    assert instructions[0] == ("FROM", "python:3.11-slim")
    runs = [rest for kw, rest in instructions if kw == "RUN"]
    assert any('pip install ".[postgres]"' in r for r in runs), runs


def test_dockerfile_copies_every_package() -> None:
    """pip install . needs pyproject.toml and every package pyproject declares."""
    copied = set()
    for kw, rest in dockerfile_instructions():
        if kw == "COPY":
            copied.update(part.rstrip("/") for part in rest.split()[:-1])
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert "pyproject.toml" in copied
    assert packages <= copied, f"Dockerfile does not copy {sorted(packages - copied)}"
