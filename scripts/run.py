"""`make run`: migrate, seed the demo, and start every process the platform needs.

Web server (granian: gpushare.serve), Celery worker, Celery beat, one node agent on
simulated GPUs and the endpoint gateway, supervised by honcho; Ctrl-C stops
them all. Embedded defaults (SQLite + kombu's filesystem broker under var/)
unless DATABASE_URL and REDIS_URL are set.

Once every process answers its readiness check (web, gateway, agent, worker
and beat: ``/readyz`` on each one's port), it prints one line, "gpushare is
ready at http://...", with the logins; periodic tasks stay quiet at the
default log level (LOG_LEVEL=DEBUG shows them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PORT = os.environ.get("PORT", "8000")
GATEWAY_PORT = os.environ.get("GATEWAY_PORT", str(int(PORT) + 1))
STRIPE_PORT = os.environ.get("LOCALSTRIPE_PORT", str(int(PORT) + 420))
# Health and metrics ports of the processes that have no web server of their own (127.0.0.1 only).
AGENT_OPS_PORT, WORKER_OPS_PORT, BEAT_OPS_PORT = (str(int(PORT) + n) for n in (2, 3, 4))
READY_TIMEOUT_S = float(os.environ.get("GPUSHARE_READY_TIMEOUT_S", "300"))
NODE = os.environ.get("GPUSHARE_DEMO_NODE", "sim-node-1")
SIM_GPUS = os.environ.get("GPUSHARE_DEMO_GPUS", "sim:2xH100-80GB,2xL4-24GB")


def manage(*args: str, capture: bool = False) -> str:
    result = subprocess.run(
        [str(BIN / "python"), "manage.py", *args], cwd=ROOT, check=True, text=True, capture_output=capture
    )
    return result.stdout if capture else ""


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpushare.settings.dev")
    # Without a real Stripe key, payments go to localstripe (an offline Stripe emulator) started below.
    offline_stripe = "STRIPE_API_KEY" not in os.environ
    if offline_stripe:
        os.environ["STRIPE_API_BASE"] = f"http://127.0.0.1:{STRIPE_PORT}"
        os.environ["STRIPE_LOCALSTRIPE"] = "1"
    var = Path(os.environ.setdefault("GPUSHARE_VAR_DIR", str(ROOT / "var")))
    var.mkdir(parents=True, exist_ok=True)
    # The SQLite database (every tenant's job environment), the filesystem broker and the agent's
    # state: no other user, and no job uid, may enter (docs/operator-guide.md, Security model).
    os.chmod(var, 0o700)
    agent_flags = ""
    work_root = None
    if os.geteuid() == 0:  # multi-tenant agent: job work dirs outside var/, on a path every job uid can enter
        work_root = Path(os.environ.get("GPUSHARE_AGENT_WORK_ROOT", f"/var/tmp/gpushare-{PORT}/jobs"))
        work_root.parent.mkdir(mode=0o711, parents=True, exist_ok=True)
        os.chmod(work_root.parent, 0o711)
        agent_flags = f" --work-root {work_root}"
    manage("migrate", "--noinput", "-v", "0")
    manage("collectstatic", "--noinput", "-v", "0")
    demo = json.loads(manage("seed_demo", "--node", NODE, capture=True).strip().splitlines()[-1])
    # The platform signs every command to the agent; the agent trusts the keys nodelink_keygen prints.
    (var / "nodelink-trusted.pub").write_text(manage("nodelink_keygen", capture=True))
    os.environ["GPUSHARE_NODELINK_PUBLIC_KEY_FILE"] = str(var / "nodelink-trusted.pub")
    (var / "demo.json").write_text(json.dumps(demo, indent=2))
    python = BIN / "python"
    procfile = var / "Procfile"
    webhook = f"http://127.0.0.1:{PORT}/billing/stripe/webhook/"
    stripe_line = (
        f"stripe: sh -c '{python} -m localstripe --port {STRIPE_PORT} --from-scratch & sleep 3; "
        f"{python} manage.py localstripe_webhook --url {webhook}; wait'"
    )
    procfile.write_text(
        "\n".join(
            [
                f"web: {python} -m gpushare.serve --bind 127.0.0.1:{PORT} --workers 2",
                f"worker: GPUSHARE_METRICS_PORT={WORKER_OPS_PORT} {BIN / 'celery'} -A gpushare worker -Q platform -c 2"
                " -l info --without-gossip --without-mingle",
                f"beat: GPUSHARE_METRICS_PORT={BEAT_OPS_PORT} {BIN / 'celery'} -A gpushare beat -l info"
                f" -s {var / 'celerybeat-schedule'}",
                f"agent: {python} -m agents --node {NODE} --gpus {SIM_GPUS} --var-dir {var}"
                f" --metrics-port {AGENT_OPS_PORT}{agent_flags}",
                f"gateway: {python} -m endpoints --port {GATEWAY_PORT}",
                *([stripe_line] if offline_stripe else []),
            ]
        )
        + "\n"
    )
    os.environ["GPUSHARE_AGENT_TOKEN"] = demo["node"]["token"]
    os.environ.setdefault("GPUSHARE_GATEWAY_URL", f"http://127.0.0.1:{GATEWAY_PORT}")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    base = f"http://127.0.0.1:{PORT}"
    mode = "SQLite + embedded broker" if "DATABASE_URL" not in os.environ else "DATABASE_URL"
    print(f"gpushare is starting ({mode}); it says when it is ready", flush=True)
    os.chdir(ROOT)
    honcho = subprocess.Popen([str(BIN / "honcho"), "start", "-f", str(procfile), "-d", str(ROOT)])
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda n, _f: honcho.send_signal(n))
    if wait_ready(
        honcho,
        {
            "web": f"{base}/readyz",
            "gateway": f"http://127.0.0.1:{GATEWAY_PORT}/readyz",
            "agent": f"http://127.0.0.1:{AGENT_OPS_PORT}/readyz",
            "worker": f"http://127.0.0.1:{WORKER_OPS_PORT}/readyz",
            "beat": f"http://127.0.0.1:{BEAT_OPS_PORT}/readyz",
        },
    ):
        print(ready_banner(demo, base, var), flush=True)
    status = honcho.wait()
    if work_root is not None:  # the jobs' work dirs of this run (each attempt's is removed when it ends)
        shutil.rmtree(work_root.parent, ignore_errors=True)
    sys.exit(status)


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_ready(honcho: subprocess.Popen, checks: dict[str, str]) -> bool:
    """Poll every readiness URL until all answer 200 (False if honcho ends or time runs out)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    waiting = dict(checks)
    while waiting and time.monotonic() < deadline:
        if honcho.poll() is not None:
            return False
        waiting = {name: url for name, url in waiting.items() if not answers(url)}
        if waiting:
            time.sleep(0.5)
    if waiting:
        print(f"gpushare is NOT ready after {READY_TIMEOUT_S:.0f} s: {', '.join(waiting)} not answering", flush=True)
        return False
    return True


def ready_banner(demo: dict, base: str, var: Path) -> str:
    acme, globex = demo["tenants"]["acme"], demo["tenants"]["globex"]
    password = demo["password"]
    operator = demo.get("operator", "operator")
    ready = (
        f"gpushare is ready at {base}/ , logins: {operator} / {password} (admin), {acme['user']} / {password} (acme), "
        f"{globex['user']} / {password} (globex); API token acme: {acme['token']} (all in {var / 'demo.json'})"
    )
    submit = '{"kind": "training", "gpus": 1, "command": ["sh", "-c", "echo $CUDA_VISIBLE_DEVICES"]}'
    return "\n".join(
        [
            "",
            ready,
            "",
            f"  admin       {base}/admin/   console {base}/console/   API docs {base}/api/docs/",
            f"  endpoints   http://127.0.0.1:{GATEWAY_PORT}/e/<tenant>/<endpoint>/   (inference gateway)",
            f"  health      /readyz and /metrics on web :{PORT}, gateway :{GATEWAY_PORT}, agent :{AGENT_OPS_PORT},"
            f" worker :{WORKER_OPS_PORT}, beat :{BEAT_OPS_PORT}",
            f"  node        {NODE} with {SIM_GPUS}",
            f"  try:        curl -s -X POST {base}/api/v1/jobs/ -H 'Authorization: Bearer {acme['token']}' \\",
            f"                -H 'Content-Type: application/json' -d '{submit}'",
            f"              curl -s http://127.0.0.1:{GATEWAY_PORT}/e/acme/echo/"
            f" -H 'Authorization: Bearer {acme['token']}' -d hello",
            '                (the demo endpoint "echo": scaled to zero, its first request starts a replica)',
            "  Ctrl-C stops everything.",
            "",
        ]
    )


if __name__ == "__main__":
    main()
