"""The agent's configuration: command-line flags and environment variables,
and the GPU backend they choose."""

from __future__ import annotations

import argparse
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from .address import address_valid
from .gpus import SimBackend
from .jobs import DEFAULT_ENV_ALLOW
from .logs import logging_setup

log = logging.getLogger("gpushare.agent")


@dataclass
class AgentConfig:
    node: str
    token: str
    broker_url: str
    var_dir: Path
    gpus: str = "auto"
    allow_sim: bool = False
    sample_interval_s: float = 1.0
    window_s: float = 10.0
    heartbeat_s: float = 5.0
    log_cap_bytes: int = 64 << 20
    run_as: str = ""
    env_allow: tuple[str, ...] = DEFAULT_ENV_ALLOW
    shutdown_grace_s: int = 10
    cgroup_root: str = ""  # "", "off", "auto" or a cgroup v2 directory: one cgroup per job
    docker: str = "docker"  # the docker CLI used for jobs that name an image
    advertise_address: str = ""  # where the gateway reaches this node's replicas; "": detected at registration
    metrics_port: int = 0  # /healthz /readyz /metrics (agents/agent/metrics.py); 0: off
    metrics_address: str = "127.0.0.1"
    metrics_token: str = ""

    @property
    def state_dir(self) -> Path:
        return self.var_dir / "agent" / self.node


def backend_for(config: AgentConfig):
    """The GPU backend the configuration asks for; never simulate silently on a GPU host."""
    if config.gpus.startswith("sim:"):
        return SimBackend(config.gpus, config.node)
    from .nvml import NvmlBackend, NvmlUnavailable, nvidia_devices_present

    try:
        return NvmlBackend(state_dir=config.state_dir)
    except NvmlUnavailable as exc:
        if config.gpus == "nvml":
            raise SystemExit(f"gpushare-agent: --gpus nvml but NVML is not usable: {exc}") from exc
        if nvidia_devices_present():
            raise SystemExit(
                f"gpushare-agent: this host has NVIDIA devices but NVML failed ({exc}); refusing to simulate. "
                "Fix the driver, or pass --gpus sim:... explicitly."
            ) from exc
        if not config.allow_sim:
            raise SystemExit(
                f"gpushare-agent: no NVML on this host ({exc}). Pass --gpus sim:2xH100-80GB (or --allow-sim) "
                "to run on simulated GPUs."
            ) from exc
        log.warning("no NVML (%s): simulating one H100-80GB", exc)
        return SimBackend("sim:1xH100-80GB", config.node)


def parse_args(argv: list[str] | None = None) -> AgentConfig:
    env = os.environ
    parser = argparse.ArgumentParser(prog="gpushare-agent", description="gpushare node agent")
    parser.add_argument("--node", default=env.get("GPUSHARE_NODE", socket.gethostname().split(".")[0]))
    parser.add_argument(
        "--token",
        default=env.get("GPUSHARE_AGENT_TOKEN", ""),
        help="the node's credential; prefer GPUSHARE_AGENT_TOKEN or --token-file (argv is world-readable)",
    )
    parser.add_argument("--token-file", default=env.get("GPUSHARE_AGENT_TOKEN_FILE", ""), help="file holding the token")
    parser.add_argument(
        "--broker",
        default=env.get("GPUSHARE_BROKER_URL")
        or env.get("CELERY_BROKER_URL")
        or env.get("REDIS_URL")
        or "filesystem://",
    )
    parser.add_argument("--var-dir", default=env.get("GPUSHARE_VAR_DIR", "var"))
    parser.add_argument(
        "--gpus",
        default=env.get("GPUSHARE_GPUS", "auto"),
        help="auto (NVML), nvml, or sim:2xH100-80GB,2xL4-24GB",
    )
    parser.add_argument("--allow-sim", action="store_true", help="simulate when the host has no NVIDIA driver")
    parser.add_argument("--sample-interval", type=float, default=float(env.get("GPUSHARE_SAMPLE_INTERVAL_S", "1")))
    parser.add_argument("--window", type=float, default=float(env.get("GPUSHARE_WINDOW_S", "10")))
    parser.add_argument("--heartbeat", type=float, default=float(env.get("GPUSHARE_HEARTBEAT_INTERVAL_S", "5")))
    parser.add_argument("--log-cap-mb", type=int, default=int(env.get("GPUSHARE_LOG_CAP_MB", "64")))
    parser.add_argument("--run-as", default=env.get("GPUSHARE_RUN_AS", ""), help="run jobs as this user")
    parser.add_argument(
        "--cgroup-root",
        default=env.get("GPUSHARE_CGROUP_ROOT", ""),
        help="put each job in its own cgroup v2 under this directory ('auto': the agent's own cgroup)",
    )
    parser.add_argument(
        "--advertise-address",
        default=env.get("GPUSHARE_AGENT_ADVERTISE_ADDRESS", ""),
        help="IP address or host name the gateway uses to reach replicas on this node "
        "(default: this host's address on its route to the broker)",
    )
    parser.add_argument("--log-level", default=env.get("LOG_LEVEL", "INFO"))
    parser.add_argument("--log-format", choices=["plain", "json"], default=env.get("LOG_FORMAT", "plain"))
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(env.get("GPUSHARE_AGENT_METRICS_PORT", "0")),
        help="serve /healthz, /readyz and /metrics (dcgm-exporter names) on this port; 0: off",
    )
    parser.add_argument("--metrics-address", default=env.get("GPUSHARE_AGENT_METRICS_ADDR", "127.0.0.1"))
    args = parser.parse_args(argv)
    logging_setup(level=args.log_level, fmt=args.log_format, node=args.node)
    if args.token_file:
        try:
            args.token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            parser.error(f"cannot read --token-file {args.token_file}: {exc.strerror}")
    elif args.token and args.token != env.get("GPUSHARE_AGENT_TOKEN"):
        log.warning(
            "the node token was given on the command line, where any local user (and any job) can read it in "
            "/proc/<pid>/cmdline; use GPUSHARE_AGENT_TOKEN or --token-file instead"
        )
    if not args.token:
        parser.error("the node's credential is required: --token-file, GPUSHARE_AGENT_TOKEN or --token")
    if args.sample_interval <= 0 or args.window < args.sample_interval:
        parser.error("--sample-interval must be positive and --window at least one sample interval")
    args.advertise_address = args.advertise_address.strip()
    if args.advertise_address and not address_valid(args.advertise_address):
        parser.error(f"--advertise-address {args.advertise_address!r} is neither an IP address nor a host name")
    return AgentConfig(
        node=args.node,
        token=args.token,
        broker_url=args.broker,
        var_dir=Path(args.var_dir).resolve(),
        gpus=args.gpus,
        allow_sim=args.allow_sim,
        sample_interval_s=args.sample_interval,
        window_s=args.window,
        heartbeat_s=args.heartbeat,
        log_cap_bytes=args.log_cap_mb << 20,
        run_as=args.run_as,
        cgroup_root=args.cgroup_root,
        advertise_address=args.advertise_address,
        metrics_port=args.metrics_port,
        metrics_address=args.metrics_address,
        metrics_token=env.get("GPUSHARE_METRICS_TOKEN", ""),  # never on argv
    )
