"""docker-compose.yml: valid Compose (the spec's JSON schema always; `docker compose config`
when a compose binary is installed), every long-running service with a health check, the
gateway included, every secret required with no default (a missing one is named), the agent's
outbox on a volume, and .env.example naming every variable the file reads."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent.parent
COMPOSE = ROOT / "docker-compose.yml"
SCHEMA = ROOT / "deploy" / "compose" / "compose-spec.schema.json"
SECRETS = {
    "SECRET_KEY",
    "POSTGRES_PASSWORD",
    "REDIS_PASSWORD",
    "ALLOWED_HOSTS",
    "STRIPE_API_KEY",
    "STRIPE_WEBHOOK_SECRET",
    "GPUSHARE_METRICS_TOKEN",
}
ONE_SHOT = {"migrate", "node-credential"}
FILLED = {
    "SECRET_KEY": "q3Vb8kP1zR7mN2xT5wY9cF4hJ6gL0sD3aE8uI1oK7pQ2rV5bX9nM4",
    "POSTGRES_PASSWORD": "pg-0123456789",
    "REDIS_PASSWORD": "redis-0123456789",
    "ALLOWED_HOSTS": "gpushare.example.com",
    "STRIPE_API_KEY": "sk_live_0123456789",
    "STRIPE_WEBHOOK_SECRET": "whsec_0123456789",
    "GPUSHARE_METRICS_TOKEN": "metrics-0123456789abcdef",
}
VARIABLE = re.compile(r"\$\{([A-Z0-9_]+)(:?[-?])?([^}]*)\}")


def compose_file() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.mark.parametrize("path", [COMPOSE, ROOT / "deploy" / "compose" / "test-services.yml"])
def test_valid_against_the_compose_spec_schema(path):
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft7Validator(schema).validate(yaml.safe_load(path.read_text()))


def test_every_service_is_there_with_a_health_check():
    services = compose_file()["services"]
    assert {"postgres", "redis", "migrate", "web", "worker", "beat", "gateway", "agent", "agent-nvidia"} <= set(
        services
    )
    for name, service in services.items():
        if name in ONE_SHOT:
            assert service["restart"] == "no", name
            continue
        assert service.get("healthcheck", {}).get("test"), f"{name} has no health check"
    assert "readyz" in " ".join(services["web"]["healthcheck"]["test"])
    assert "readyz" in " ".join(services["gateway"]["healthcheck"]["test"])
    assert services["worker"]["healthcheck"]["test"][-1] == "worker"
    assert services["beat"]["healthcheck"]["test"][-1] == "beat"


def test_secrets_are_required_and_have_no_default():
    text = COMPOSE.read_text()
    uses = VARIABLE.findall(text)
    for name, op, _rest in uses:
        if name in SECRETS:
            assert op == ":?", f"${{{name}}} must be ${{{name}:?...}} (required, no default)"
    assert {name for name, _, _ in uses} >= SECRETS
    for known in ("change-me-in-production", "whsec_local", "sk_test_local", "POSTGRES_HOST_AUTH_METHOD"):
        assert known not in text
    # The agent's credential comes from a file in a volume, never from the environment.
    agent = compose_file()["services"]["agent"]
    assert "GPUSHARE_AGENT_TOKEN" not in agent["environment"]
    assert agent["environment"]["GPUSHARE_AGENT_TOKEN_FILE"].startswith("/app/var/credential/")


def test_the_agent_outbox_is_on_a_volume():
    compose = compose_file()
    for name in ("agent", "agent-nvidia"):
        mounts = {m.split(":")[1]: m.split(":")[0] for m in compose["services"][name]["volumes"]}
        assert mounts["/app/var/agent"] in compose["volumes"], name  # var/agent/<node>/state.sqlite3
    assert compose["services"]["agent-nvidia"]["pid"] == "host"


def test_env_example_names_every_variable():
    names = {name for name, _, _ in VARIABLE.findall(COMPOSE.read_text())}
    example = {
        line.split("=", 1)[0]
        for line in (ROOT / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    }
    assert names <= example, sorted(names - example)
    for secret in SECRETS:
        assert f"\n{secret}=\n" in (ROOT / ".env.example").read_text(), f"{secret} must be blank in .env.example"


def compose_binary() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


@pytest.fixture
def compose(tmp_path):
    binary = compose_binary()
    if binary is None:
        pytest.skip("no compose binary (apt-get install docker-compose); the schema tests above still ran")

    def run(env: dict) -> subprocess.CompletedProcess:
        env_file = tmp_path / "env"
        env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
        return subprocess.run(
            [*binary, "--project-directory", str(ROOT), "-f", str(COMPOSE), "--env-file", str(env_file),
             "--profile", "nvidia", "config"],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
            env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path)},
        )  # fmt: skip

    return run


def test_compose_config_accepts_the_filled_example(compose):
    result = compose(FILLED)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    web = config["services"]["web"]["environment"]
    assert web["SECRET_KEY"] == FILLED["SECRET_KEY"] and web["DJANGO_SETTINGS_MODULE"] == "gpushare.settings.production"
    assert "gpushare:redis-0123456789" not in web["DATABASE_URL"] and "pg-0123456789@postgres" in web["DATABASE_URL"]


@pytest.mark.parametrize("missing", sorted(SECRETS))
def test_compose_config_names_each_missing_secret(compose, missing):
    result = compose({k: v for k, v in FILLED.items() if k != missing})
    assert result.returncode != 0
    assert f"set {missing} in .env" in result.stderr, result.stderr
