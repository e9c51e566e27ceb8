"""The agent's configuration: command-line flags and environment variables,
and the GPU backend they choose."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from .address import address_valid
from .gpus import SimBackend
from .jobs import DEFAULT_ENV_ALLOW
from .logs import logging_setup
from .sandbox import DEFAULT_UID_POOL, searchable_dir, uid_pool_parse

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
    # Tenant isolation (agents/agent/sandbox.py, netpolicy.py; docs/operator-guide.md "Security model").
    tenancy: str = "auto"  # auto (multi when root) | multi | single
    uid_pool: tuple[int, int] = DEFAULT_UID_POOL
    work_root: Path | None = None  # job work dirs; default <var-dir>/jobs/<node>
    keep_workdir_min: float = 0.0  # keep a finished attempt's work dir this long (debugging)
    job_disk_mb: int = 100 * 1024  # a job's work dir may hold this much; 0: unbounded
    disk_check_s: float = 5.0
    job_nproc: int = 16384
    job_nofile: int = 65536
    network_policy: str = "nft"  # nft | off (multi-tenant only)
    job_egress: str = "allow"  # allow | deny
    platform_addresses: tuple[str, ...] = ()
    gateway_addresses: tuple[str, ...] = ()
    replica_ports: tuple[int, int] = (20000, 29999)
    allowed_registries: tuple[str, ...] = ()
    docker_pids_limit: int = 4096
    docker_network: str = ""  # "": docker's default bridge
    jobexec: str = "auto"  # the launch helper (jobexec.py): auto, off (the Python drop) or its path

    @property
    def state_dir(self) -> Path:
        return self.var_dir / "agent" / self.node

    @property
    def jobs_root(self) -> Path:
        return self.work_root or self.var_dir / "jobs" / self.node

    @property
    def multi_tenant(self) -> bool:
        return self.tenancy == "multi"


def backend_for(config: AgentConfig):
    """The GPU backend the configuration asks for; never simulate silently on a GPU host."""
    if config.gpus.startswith("sim:"):
        return SimBackend(config.gpus, config.node)
    from .nvml import NvmlBackend, NvmlUnavailable, nvidia_devices_present

    try:
        # MPS pipe dirs live beside the work dirs: job uids must reach them, the agent's state they must not.
        return NvmlBackend(state_dir=searchable_dir(config.jobs_root.parent / f".{config.node}-gpu"))
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
        default=env.get("GPUSHARE_AGENT_TOKEN", ""),  # main() takes it out of the environment
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
    iso = parser.add_argument_group("tenant isolation (docs/operator-guide.md, Security model)")
    iso.add_argument(
        "--tenancy",
        choices=["auto", "multi", "single"],
        default=env.get("GPUSHARE_AGENT_TENANCY", "auto"),
        help="multi: a uid per job, private dirs, network policy (needs root); single: jobs run as the agent's "
        "user (or --run-as), for one tenant only; auto: multi when started as root",
    )
    iso.add_argument(
        "--uid-pool",
        default=env.get("GPUSHARE_AGENT_UID_POOL", "{}-{}".format(*DEFAULT_UID_POOL)),
        help="uids handed to job attempts (no host account may live there)",
    )
    iso.add_argument("--work-root", default=env.get("GPUSHARE_AGENT_WORK_ROOT", ""), help="where job work dirs go")
    iso.add_argument(
        "--keep-workdir-minutes", type=float, default=float(env.get("GPUSHARE_AGENT_KEEP_WORKDIR_MINUTES", "0"))
    )
    iso.add_argument("--job-disk-mb", type=int, default=int(env.get("GPUSHARE_AGENT_JOB_DISK_MB", str(100 * 1024))))
    iso.add_argument("--disk-check-interval", type=float, default=float(env.get("GPUSHARE_AGENT_DISK_CHECK_S", "5")))
    iso.add_argument("--job-nproc", type=int, default=int(env.get("GPUSHARE_AGENT_JOB_NPROC", "16384")))
    iso.add_argument("--job-nofile", type=int, default=int(env.get("GPUSHARE_AGENT_JOB_NOFILE", "65536")))
    iso.add_argument(
        "--network-policy", choices=["nft", "off"], default=env.get("GPUSHARE_AGENT_NETWORK_POLICY", "nft")
    )
    iso.add_argument("--job-egress", choices=["allow", "deny"], default=env.get("GPUSHARE_AGENT_JOB_EGRESS", "allow"))
    iso.add_argument(
        "--platform-addresses",
        default=env.get("GPUSHARE_AGENT_PLATFORM_ADDRESSES", ""),
        help="comma-separated CIDRs no job may reach (the database, the broker, the web servers)",
    )
    iso.add_argument(
        "--gateway-addresses",
        default=env.get("GPUSHARE_AGENT_GATEWAY_ADDRESSES", ""),
        help="comma-separated CIDRs of remote gateways allowed into replica ports (the node itself always is)",
    )
    iso.add_argument("--replica-ports", default=env.get("GPUSHARE_AGENT_REPLICA_PORTS", "20000-29999"))
    iso.add_argument(
        "--allowed-registries",
        default=env.get("GPUSHARE_ALLOWED_REGISTRIES", ""),
        help="comma-separated registries image jobs may use (empty: any)",
    )
    iso.add_argument(
        "--docker", default=env.get("GPUSHARE_AGENT_DOCKER", "docker"), help="the docker CLI for image jobs"
    )
    iso.add_argument("--docker-pids-limit", type=int, default=int(env.get("GPUSHARE_AGENT_DOCKER_PIDS_LIMIT", "4096")))
    iso.add_argument("--docker-network", default=env.get("GPUSHARE_AGENT_DOCKER_NETWORK", ""))
    iso.add_argument(
        "--jobexec",
        default=env.get("GPUSHARE_AGENT_JOBEXEC", "auto"),
        help="the launch helper that drops a job's privileges in C (make native builds it): auto (the build's "
        "when present), off (the same drop in Python, ~2 ms more per launch) or its path",
    )
    args = parser.parse_args(argv)
    logging_setup(level=args.log_level, fmt=args.log_format, node=args.node)
    if args.token_file:
        try:
            args.token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            parser.error(f"cannot read --token-file {args.token_file}: {exc.strerror}")
        _token_file_check(Path(args.token_file))
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
    tenancy = args.tenancy
    if tenancy == "auto":
        tenancy = "multi" if os.geteuid() == 0 else "single"
    if tenancy == "multi" and os.geteuid() != 0:
        parser.error("--tenancy multi needs root (a uid per job); start the agent as root, or use --tenancy single")
    if tenancy == "multi" and args.run_as:
        parser.error("--run-as is for single-tenant nodes; a multi-tenant node runs each job as its own pool uid")
    try:
        uid_pool = uid_pool_parse(args.uid_pool)
        replica_ports = _port_range(args.replica_ports or "20000-29999")
        addresses = {
            name: tuple(str(ipaddress.ip_network(c.strip(), strict=False)) for c in value.split(",") if c.strip())
            for name, value in (("platform", args.platform_addresses), ("gateway", args.gateway_addresses))
        }
    except ValueError as exc:
        parser.error(str(exc))
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
        tenancy=tenancy,
        uid_pool=uid_pool,
        work_root=Path(args.work_root).resolve() if args.work_root else None,
        keep_workdir_min=max(args.keep_workdir_minutes, 0.0),
        job_disk_mb=max(args.job_disk_mb, 0),
        disk_check_s=max(args.disk_check_interval, 0.2),
        job_nproc=max(args.job_nproc, 0),
        job_nofile=max(args.job_nofile, 64),
        network_policy=args.network_policy,
        job_egress=args.job_egress,
        platform_addresses=addresses["platform"],
        gateway_addresses=addresses["gateway"],
        replica_ports=replica_ports,
        allowed_registries=tuple(r.strip().lower() for r in args.allowed_registries.split(",") if r.strip()),
        docker_pids_limit=max(args.docker_pids_limit, 1),
        docker_network=args.docker_network.strip(),
        docker=args.docker,
        jobexec=args.jobexec.strip() or "auto",
    )


def _token_file_check(path: Path) -> None:
    """A token file others can read is refused: any job uid could read the node's credential from it."""
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise SystemExit(
            f"gpushare-agent: --token-file {path} is mode {mode:o}; it must be readable by the agent only "
            f"(chmod 600 {path})"
        )


def _port_range(text: str) -> tuple[int, int]:
    low, _, high = text.strip().partition("-")
    try:
        first, last = int(low), int(high or low)
    except ValueError:
        raise ValueError(f"port range {text!r} is not FIRST-LAST") from None
    if not 1 <= first <= last <= 65535:
        raise ValueError(f"port range {text!r} must be within 1-65535, first <= last")
    return first, last
