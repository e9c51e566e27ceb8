"""`make run`: migrate, seed the demo, and start every process the platform needs.

Web server (gunicorn), Celery worker, Celery beat and one node agent on
simulated GPUs, supervised by honcho; Ctrl-C stops them all. Embedded
defaults (SQLite + kombu's filesystem broker under var/) unless DATABASE_URL
and REDIS_URL are set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PORT = os.environ.get("PORT", "8000")
GATEWAY_PORT = os.environ.get("GATEWAY_PORT", str(int(PORT) + 1))
STRIPE_PORT = os.environ.get("LOCALSTRIPE_PORT", str(int(PORT) + 420))
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
    manage("migrate", "--noinput", "-v", "0")
    manage("collectstatic", "--noinput", "-v", "0")
    demo = json.loads(manage("seed_demo", "--node", NODE, capture=True).strip().splitlines()[-1])
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
                f"web: {BIN / 'gunicorn'} gpushare.wsgi -b 127.0.0.1:{PORT} -w 2 --threads 4 --access-logfile -",
                f"worker: {BIN / 'celery'} -A gpushare worker -Q platform -c 2 -l info",
                f"beat: {BIN / 'celery'} -A gpushare beat -l info -s {var / 'celerybeat-schedule'}",
                f"agent: {python} -m agents --node {NODE} --gpus {SIM_GPUS} --var-dir {var}",
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
    acme = demo["tenants"]["acme"]
    print(
        f"""
  gpushare is starting ({"SQLite + embedded broker" if "DATABASE_URL" not in os.environ else "DATABASE_URL"})

  portal      {base}/
  admin       {base}/admin/       login: {demo.get("operator", "operator")} / {demo["password"]}
  API docs    {base}/api/docs/
  console     {base}/console/      (operator: fleet, queue, rules with what-if)
  endpoints   http://127.0.0.1:{GATEWAY_PORT}/e/<tenant>/<endpoint>/   (inference gateway)
  tenants     acme:   {acme["user"]} / {demo["password"]}
              globex: {demo["tenants"]["globex"]["user"]} / {demo["password"]}
  API tokens  acme:   {acme["token"]}
              globex: {demo["tenants"]["globex"]["token"]}
  node        {NODE} with {SIM_GPUS}

  try:
    curl -s -X POST {base}/api/v1/jobs/ -H "Authorization: Bearer {acme["token"]}" \\
      -H 'Content-Type: application/json' \\
      -d '{{"kind": "training", "gpus": 1, "command": ["sh", "-c", "echo $CUDA_VISIBLE_DEVICES"]}}'
    curl -s http://127.0.0.1:{GATEWAY_PORT}/e/acme/echo/ -H "Authorization: Bearer {acme["token"]}" -d hello
      (the demo endpoint "echo": scaled to zero, its first request starts a replica)

  (demo credentials are also in {var / "demo.json"}; Ctrl-C stops everything)
""",
        flush=True,
    )
    os.chdir(ROOT)
    os.execv(str(BIN / "honcho"), [str(BIN / "honcho"), "start", "-f", str(procfile), "-d", str(ROOT)])


if __name__ == "__main__":
    main()
