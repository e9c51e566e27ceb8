"""deploy/kubernetes renders (kustomize, through kubectl) and every object validates offline,
strictly (no unknown field), against the Kubernetes API schemas that kubernetes-validate ships;
then the properties the operator relies on are checked: probes and resources everywhere,
a disruption budget per workload, migrations as a Job, secrets only referenced, and the agent
DaemonSet on GPU nodes with the host PID namespace, the NVIDIA runtime and its outbox on the host."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent.parent
OVERLAY = ROOT / "deploy" / "kubernetes" / "overlays" / "production"
# The oldest Kubernetes release the manifests promise to work on, and the newest schemas shipped.
VERSIONS = ("1.29.0", kubernetes_validate.utils.latest_version())
WORKLOADS = ("gpushare-web", "gpushare-worker", "gpushare-beat", "gpushare-gateway")
SECRET_NAMES = {"gpushare", "gpushare-agent", "gpushare-agent-nodes", "gpushare-nodelink"}


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (for its kustomize) is needed to render deploy/kubernetes: apt-get install kubectl"
    result = subprocess.run([kubectl, "kustomize", str(OVERLAY)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_validates_against_the_api_schema(rendered, version):
    for doc in rendered:
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError / InvalidSchemaError
    assert len(rendered) >= 14


def test_a_broken_manifest_is_caught():
    """The validator is not a no-op: a typo'd field and a wrong type fail."""
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "x"},
        "spec": {"replicas": "two", "selector": {"matchLabels": {"a": "b"}}, "template": {"spec": {"containers": []}}},
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[0], strict=True)
    deployment["spec"]["replicas"], deployment["spec"]["replica"] = 2, 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[0], strict=True)


def containers(workload: dict) -> list[dict]:
    spec = workload["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def test_workloads_have_probes_resources_services_and_budgets(rendered):
    deployments = by_kind(rendered, "Deployment")
    assert set(deployments) == set(WORKLOADS)
    budgets = by_kind(rendered, "PodDisruptionBudget")
    for name, deployment in deployments.items():
        main = deployment["spec"]["template"]["spec"]["containers"][0]
        assert main.get("livenessProbe") and main.get("readinessProbe"), name
        for container in containers(deployment):
            assert container["resources"]["requests"]["cpu"] and container["resources"]["limits"]["memory"], name
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, name
        assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert any(b["spec"]["selector"]["matchLabels"].items() <= labels.items() for b in budgets.values()), name
    assert deployments["gpushare-beat"]["spec"]["replicas"] == 1
    assert deployments["gpushare-beat"]["spec"]["strategy"]["type"] == "Recreate"
    probes = {n: d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"] for n, d in deployments.items()}
    assert probes["gpushare-web"]["httpGet"]["path"] == "/readyz"
    assert probes["gpushare-gateway"]["httpGet"]["path"] == "/readyz"
    assert probes["gpushare-worker"]["exec"]["command"][-1] == "worker"
    assert probes["gpushare-beat"]["exec"]["command"][-1] == "beat"
    assert set(by_kind(rendered, "Service")) == {"gpushare-web", "gpushare-gateway"}
    worker = deployments["gpushare-worker"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert worker[worker.index("-Q") + 1] == "platform"


def test_migrations_run_as_a_job_and_pods_wait_for_them(rendered):
    job = by_kind(rendered, "Job")["gpushare-migrate"]
    assert job["spec"]["template"]["spec"]["containers"][0]["command"] == [
        "python",
        "manage.py",
        "migrate",
        "--noinput",
    ]
    for name, deployment in by_kind(rendered, "Deployment").items():
        init = deployment["spec"]["template"]["spec"]["initContainers"][0]
        assert "migrate --check" in init["command"][-1], name


def test_secrets_are_referenced_never_inlined(rendered):
    assert not by_kind(rendered, "Secret")
    referenced = set()
    for doc in rendered:
        text = yaml.safe_dump(doc)
        for word in ("whsec_", "sk_live_", "sk_test_", "gps_node_", "postgres://", "redis://"):
            assert word not in text, (doc["kind"], doc["metadata"]["name"], word)
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        for container in spec.get("initContainers", []) + spec.get("containers", []):
            for source in container.get("envFrom", []):
                if "secretRef" in source:
                    referenced.add(source["secretRef"]["name"])
            for env in container.get("env", []):
                if "secretKeyRef" in env.get("valueFrom", {}):
                    referenced.add(env["valueFrom"]["secretKeyRef"]["name"])
                if any(w in env["name"] for w in ("SECRET", "TOKEN", "PASSWORD")) and "value" in env:
                    assert env["name"].endswith("_FILE"), f"{env['name']} is set inline"
        for volume in spec.get("volumes", []):
            if "secret" in volume:
                referenced.add(volume["secret"]["secretName"])
    assert referenced == SECRET_NAMES


def test_the_agent_runs_on_every_gpu_node_as_nvml_needs(rendered):
    agent = by_kind(rendered, "DaemonSet")["gpushare-agent"]
    pod = agent["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["hostPID"] is True and pod["runtimeClassName"] == "nvidia"
    container = pod["containers"][0]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["outbox"] == "/app/var/agent" and volumes["outbox"]["hostPath"]["path"].startswith(
        "/var/lib/gpushare"
    )
    env = {e["name"]: e for e in container["env"]}
    assert env["GPUSHARE_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["GPUSHARE_AGENT_TOKEN_FILE"]["value"] == "/etc/gpushare/nodes/$(GPUSHARE_NODE)"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert "limits" not in container["resources"]  # its jobs are its children


def _pod(rendered, kind: str, name: str) -> tuple[dict, dict, dict]:
    pod = by_kind(rendered, kind)[name]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    mounts = {m["name"]: m for m in container.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    return pod, mounts, volumes


def test_the_signing_key_reaches_the_signers_and_only_its_public_half_the_agents(rendered):
    """Web and workers sign every command to an agent (the node link): they mount the Secret where
    GPUSHARE_NODELINK_KEY_DIR points; an agent gets the public keys only, from a ConfigMap."""
    config = by_kind(rendered, "ConfigMap")["gpushare"]["data"]
    for name in ("gpushare-web", "gpushare-worker"):
        pod, mounts, volumes = _pod(rendered, "Deployment", name)
        assert volumes["nodelink-key"]["secret"]["secretName"] == "gpushare-nodelink"
        assert mounts["nodelink-key"]["mountPath"] == config["GPUSHARE_NODELINK_KEY_DIR"]
        assert mounts["nodelink-key"]["readOnly"] is True
        mode, uid = volumes["nodelink-key"]["secret"]["defaultMode"], pod["securityContext"]["runAsUser"]
        assert mode & 0o007 == 0 and mode & 0o040 and pod["securityContext"]["fsGroup"] == uid  # readable by it alone
    pod, mounts, volumes = _pod(rendered, "DaemonSet", "gpushare-agent")
    assert all(v.get("secret", {}).get("secretName") != "gpushare-nodelink" for v in volumes.values())
    assert volumes["nodelink-public"]["configMap"]["name"] == "gpushare-nodelink-public"
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    key_file = env["GPUSHARE_NODELINK_PUBLIC_KEY_FILE"]
    assert key_file == mounts["nodelink-public"]["mountPath"] + "/trusted.pub"
