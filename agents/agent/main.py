"""The node agent: ``python -m agents`` (or the ``gpushare-agent`` script).

It never touches the platform's database: it registers its node and GPUs,
heartbeats, consumes launch/stop commands from its node's queue, runs jobs
pinned to their GPUs, meters them every sample interval, and ships usage
windows, state changes and logs through a local outbox (``spool.Spool``) that
survives broker outages and agent restarts.
"""

from __future__ import annotations

import base64
import logging
import os
import pwd
import shutil
import signal
import socket
import sys
import time
from collections import deque
from pathlib import Path

from . import __version__
from .address import address_detect
from .brokerconf import broker_options
from .cgroups import cgroup_root, leftovers_kill, pid_cgroup
from .config import AgentConfig, backend_for, parse_args
from .gpus import JobProcesses
from .health import event_describe, event_is_application_error, event_takes_gpu_out
from .imageref import image_check
from .jobexec import BUILT as JOBEXEC_BUILT
from .jobexec import JobexecUntrusted, jobexec_find, untrusted_why
from .jobs import (
    DockerOptions,
    LaunchSpec,
    RunningJob,
    container_network_problem,
    docker_available,
    docker_binary,
    env_file_problem,
    launch,
    now_ms,
    process_groups,
)
from .meter import JobMeter, split_energy
from .metrics import AgentMetrics
from .netpolicy import NetPolicy, NetPolicyError
from .protocol import (
    ACK,
    JOB_EVENTS,
    LAUNCH,
    R_COMMAND_REFUSED,
    R_HEARTBEAT,
    R_JOB_EVENTS,
    R_REGISTER,
    R_USAGE,
    REGISTER,
    STOP,
    CommandRefused,
    CommandVerifier,
    ProtocolError,
    public_keys_load,
    report_kwargs,
)
from .sandbox import (
    Drop,
    IsolationError,
    UidPool,
    disk_usage_bytes,
    private_dir,
    private_files,
    searchable_dir,
    secret_from_env,
    traversable_by_others,
    uid_kill_all,
    workdir_make,
)
from .spool import Spool
from .transport import BrokerLink, Command

log = logging.getLogger("gpushare.agent")

LOG_CHUNK = 64 * 1024
OUTBOX_BATCH = 200
EVENTS_PER_MESSAGE = 100  # job starts/exits per agents.job_events message
# Commands handled per loop step before reaping and flushing (acknowledgements come in bursts).
COMMANDS_PER_STEP = 200
# Within a burst of commands (a pass's wave of launches), jobs that ended are reaped and reported at least
# this often, so the platform places the next ones while the rest of the burst is still being launched.
REAP_WITHIN_BURST_S = 0.05
LOG_KEEP_S = 24 * 3600  # a finished job's log file stays this long in the agent's (private) state dir


def _batch_at(rows: list, i: int) -> list:
    """The outbox rows from ``i`` that travel in one message: consecutive usage windows, or consecutive
    job starts and exits (at most ``EVENTS_PER_MESSAGE``); any other report alone."""
    task = rows[i][1]
    if task == R_USAGE:
        same, limit = (lambda t: t == R_USAGE), len(rows)
    elif task in JOB_EVENTS:
        same, limit = (lambda t: t in JOB_EVENTS), i + EVENTS_PER_MESSAGE
    else:
        return rows[i : i + 1]
    end = i + 1
    while end < min(len(rows), limit) and same(rows[end][1]):
        end += 1
    return rows[i:end]


class Agent:
    def __init__(self, config: AgentConfig, backend, link: BrokerLink, spool: Spool, verifier=None):
        self.config = config
        # Checks every command's signature, node, expiry and nonce (protocol.CommandVerifier); None: refuse all.
        self.verifier: CommandVerifier | None = verifier
        # A report sent but not acknowledged by the platform is sent again after this long.
        self.resend_after_s = float(os.environ.get("GPUSHARE_AGENT_RESEND_S", "30"))
        self.commands_refused = 0
        self.backend = backend
        self.link = link
        self.spool = spool
        self.gpus = {g.uuid: g for g in backend.inventory()}
        self.jobs: dict[int, RunningJob] = {}
        # Attempts this agent ran to the end: a launch sent again (the platform
        # re-sends launches that never reported a start) must not run them twice.
        self.finished: deque[tuple[int, int]] = deque(maxlen=10_000)
        self.meters: dict[int, JobMeter] = {}
        self.energy_prev: dict[str, int] = {}
        self.stopping = False
        self.was_connected = False
        self.deferred: dict[int, LaunchSpec] = {}  # job id -> newer attempt waiting for the old one to end
        self.next_reconnect = 0.0
        self.next_heartbeat = 0.0
        self.last_metrics: dict[str, dict] = {}
        self.run_as = self._run_as(config.run_as)
        self.cgroup_root = cgroup_root(config.cgroup_root)
        self.multi_tenant = config.multi_tenant
        self.container_network_checked: tuple[float, str] = (-1e9, "")  # (monotonic time, problem)
        # The agent's own files: 0700 dirs, 0600 files (the umask is 077 from main()).
        private_dir(config.state_dir.parent)
        private_dir(config.state_dir)
        private_files(config.state_dir)
        self.logs_dir = private_dir(config.state_dir / "logs")
        self.env_dir = private_dir(config.state_dir / "env")
        # Job work dirs: the root may be entered (0711) but not listed; each work dir is 0700, its job's own.
        self.jobs_dir = searchable_dir(config.jobs_root)
        os.chmod(self.jobs_dir, 0o711)
        self.workdir_expiry: dict[Path, tuple[float, int | None]] = {}  # kept work dir -> (remove at, uid)
        self.pool: UidPool | None = None
        self.netpolicy: NetPolicy | None = None
        self.jobexec = self._jobexec_find(config.jobexec)
        if self.multi_tenant:
            self._isolation_setup()
        self.metrics = AgentMetrics(self)  # Prometheus, /healthz, /readyz (metrics.py)

    def _isolation_setup(self) -> None:
        """Multi-tenant: the uid pool and the network policy, or no start at all (never a silent fallback)."""
        config = self.config
        blocked = traversable_by_others(self.jobs_dir)
        if blocked is not None:
            raise IsolationError(
                f"job uids cannot reach their work dirs under {self.jobs_dir}: {blocked} is not searchable by "
                "others (o+x); pass --work-root on a path every user can traverse"
            )
        first, last = config.uid_pool
        self.pool = UidPool(first, last, lock_dir=Path("/run/gpushare/uids"))
        accounts = self.pool.users_inside()
        if accounts:
            raise IsolationError(
                f"the uid pool {first}-{last} holds host accounts ({', '.join(accounts[:5])}): "
                "pick a --uid-pool no account uses"
            )
        if config.network_policy == "nft":
            self.netpolicy = NetPolicy(
                node=config.node,
                uid_first=first,
                uid_last=last,
                replica_ports=config.replica_ports,
                gateways=list(config.gateway_addresses),
                platform=list(config.platform_addresses),
                egress=config.job_egress,
            )

    @staticmethod
    def _jobexec_find(setting: str) -> Path | None:
        """The launch helper (``jobexec.py``), or None for the drop in Python; a path given that cannot be
        trusted stops the start (never a silent fallback from what the operator asked for)."""
        try:
            found = jobexec_find(setting)
        except JobexecUntrusted as exc:
            raise IsolationError(str(exc)) from exc
        if found is None and setting == "auto":
            why = (
                untrusted_why(JOBEXEC_BUILT)
                if JOBEXEC_BUILT.exists()
                else f"{JOBEXEC_BUILT} is not built (make native)"
            )
            log.warning("no launch helper (%s): jobs start through the drop in Python, ~2 ms more a launch", why)
        return found

    def isolation(self) -> dict:
        """What this node enforces, as registration reports it (the console's fleet view shows it)."""
        if not self.multi_tenant:
            return {"tenancy": "single"}
        return {
            "tenancy": "multi",
            "uid_pool": "{}-{}".format(*self.config.uid_pool),
            "network_policy": "nft" if self.netpolicy else "off",
            "job_egress": self.config.job_egress,
        }

    @staticmethod
    def _run_as(user: str) -> tuple[int, int] | None:
        if not user:
            return None
        entry = pwd.getpwnam(user)
        return entry.pw_uid, entry.pw_gid

    # --- lifecycle ---------------------------------------------------------

    def run(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.recover_previous()
        if self.netpolicy is not None:
            try:
                self.netpolicy.install()
            except (NetPolicyError, OSError) as exc:
                raise IsolationError(
                    f"multi-tenant node without its network policy: {exc}. Install nftables, or pass "
                    "--network-policy off to run jobs without network isolation (said at registration)"
                ) from exc
        self._tenancy_say()
        info = self.registration()
        self.report(R_REGISTER, {"info": info})
        log.info(
            "agent %s up: %d GPU(s) via %s, broker %s, replicas reachable at %s",
            self.config.node,
            len(self.gpus),
            self.backend.name,
            self.link.url.split("@")[-1],
            info["address"],
        )
        self.metrics.serve()
        next_tick = time.monotonic()
        while not self.stopping:
            self.step(until=next_tick)
            if time.monotonic() >= next_tick:
                self.tick()
                next_tick += self.config.sample_interval_s
                if next_tick < time.monotonic():
                    next_tick = time.monotonic() + self.config.sample_interval_s
        self.shutdown()

    def _tenancy_say(self) -> None:
        if not self.multi_tenant:
            log.warning(
                "SINGLE-TENANT MODE: every job runs as %s and can read every other job's files, processes and "
                "network; do not give this node to more than one tenant (root starts it multi-tenant)",
                self.config.run_as or pwd.getpwuid(os.geteuid()).pw_name,
            )
            return
        log.info(
            "multi-tenant mode: each job as its own uid from %s-%s, work dirs under %s, network policy %s",
            *self.config.uid_pool,
            self.jobs_dir,
            "nft" if self.netpolicy else "OFF",
        )
        if self.netpolicy is None:
            log.warning("network policy OFF (--network-policy off): jobs can reach the node's local services")

    def _on_signal(self, signum, frame) -> None:
        log.info("signal %s: shutting down", signum)
        self.stopping = True

    def address(self) -> str:
        """Where the gateway reaches this node's replicas: the operator's choice, else detected.

        Detected again at every registration (startup, and after each broker
        outage) so a host whose address changed reports the new one.
        """
        return self.config.advertise_address or address_detect(self.config.broker_url)

    def registration(self) -> dict:
        return {
            "agent_version": __version__,
            "backend": self.backend.name,
            "hostname": socket.gethostname(),
            "address": self.address(),
            "gpus": [g.as_dict() for g in self.gpus.values()],
            "running": [{"job_id": j.spec.job_id, "attempt": j.spec.attempt} for j in self.jobs.values()],
            "at_ms": now_ms(),  # when "running" was true: a job placed later cannot be in it
            "isolation": self.isolation(),
            **self.backend.versions(),
        }

    def recover_previous(self) -> None:
        """Kill job processes left by a previous run of this agent.

        Their output pipes died with that run, so they cannot be re-adopted
        safely; the platform sees them missing at registration and marks
        them lost (requeued or failed per its policy). Windows metered before
        the crash are still in the outbox and are delivered.
        """
        for job_id, attempt, pgid, _started in self.spool.jobs():
            try:
                os.killpg(pgid, signal.SIGKILL)
                log.warning("killed leftover job %s attempt %s (pgid %s) from a previous run", job_id, attempt, pgid)
            except (ProcessLookupError, PermissionError):
                pass
            self.spool.job_forget(job_id=job_id, attempt=attempt)
        if self.cgroup_root is not None:
            for name in leftovers_kill(self.cgroup_root):
                log.warning("killed the processes left in cgroup %s by a previous run", name)
        if self.pool is not None:
            for uid, count in self.pool.orphans_kill().items():
                log.warning("killed %d process(es) left running as job uid %s by a previous run", count, uid)
        for path in self.jobs_dir.iterdir():  # work dirs of attempts that ended with the previous run
            if path.is_dir() and not path.name.startswith("."):
                shutil.rmtree(path, ignore_errors=True)
        for path in self.env_dir.iterdir():
            path.unlink(missing_ok=True)
        for path in self.logs_dir.iterdir():  # shipped long ago: the platform keeps the job's log
            if time.time() - path.stat().st_mtime > LOG_KEEP_S:
                path.unlink(missing_ok=True)

    def shutdown(self) -> None:
        for job in self.jobs.values():
            job.request_stop(reason="agent shutting down", grace_s=self.config.shutdown_grace_s, lost=True)
        deadline = time.monotonic() + self.config.shutdown_grace_s + 5
        while self.jobs and time.monotonic() < deadline:
            for job in list(self.jobs.values()):
                job.enforce()
            self.reap()
            time.sleep(0.1)
        # The jobs are gone: their kept work dirs and the node's nft table go now, before the flush below
        # can outlast a supervisor's patience (honcho, systemd and Kubernetes send SIGKILL after a while).
        for path, (_at, uid) in list(self.workdir_expiry.items()):
            self._workdir_remove(path, uid)
        if self.netpolicy is not None:
            self.netpolicy.remove()
        # Deliver what is left and wait (briefly) for the platform to confirm it; the rest stays in the
        # outbox for the next start.
        flush_deadline = time.monotonic() + 5
        while self.spool.pending() and time.monotonic() < flush_deadline:
            if self.ensure_connected():
                self.flush()
                self.commands_receive(0.2)
            else:
                time.sleep(0.2)
        self.metrics.stop()
        self.link.disconnect()
        self.backend.close()
        self.spool.close()

    # --- the loop ----------------------------------------------------------

    def step(self, *, until: float) -> None:
        """Wait for a command until ``until`` (at most 0.2 s), then reap and flush."""
        timeout = min(max(until - time.monotonic(), 0.0), 0.2)
        if self.ensure_connected():
            self.commands_receive(timeout)
        else:
            time.sleep(timeout)
        self.reap()
        self.flush()

    def commands_receive(self, timeout: float) -> None:
        """Handle the commands waiting (the first one waited for up to ``timeout`` s); in a long burst, reap and
        report every ``REAP_WITHIN_BURST_S``."""
        reaped = time.monotonic()
        for _ in range(COMMANDS_PER_STEP):
            try:
                command = self.link.receive(timeout=timeout)
            except Exception as exc:  # noqa: BLE001 - any broker failure: go offline, spool
                log.warning("broker connection lost: %s", exc)
                self.link.disconnect()
                return
            if command is None:
                return
            self.handle(command)
            if not self.link.connected:  # lost while acknowledging it (command_ack)
                return
            timeout = 0.0
            if time.monotonic() - reaped >= REAP_WITHIN_BURST_S:
                self.reap()
                self.flush()
                reaped = time.monotonic()

    def ensure_connected(self) -> bool:
        if self.link.connected:
            return True
        if time.monotonic() < self.next_reconnect:
            return False
        try:
            self.link.connect()
            log.info("connected to the broker; %d message(s) waiting in the outbox", self.spool.pending())
            if self.was_connected:
                # After an outage the platform may have marked the node down and its
                # jobs lost: registering again brings it back and lets it reconcile
                # (a job it gave to another node is stopped here).
                self.report(R_REGISTER, {"info": self.registration()})
            self.was_connected = True
            return True
        except Exception as exc:  # noqa: BLE001
            log.warning("broker unreachable (%s); spooling locally", exc)
            self.link.disconnect()
            self.next_reconnect = time.monotonic() + 2.0
            return False

    def handle(self, command: Command) -> None:
        """Run a command only if the platform signed it for this node, unexpired and never seen (protocol)."""
        try:
            if self.verifier is None:
                raise CommandRefused("this agent has no platform public key to verify commands", task=command.task)
            verified = self.verifier.verify(command.task, command.kwargs)
        except CommandRefused as refused:
            if refused.task == ACK and refused.reason.startswith("expired"):
                # After an outage: the reports it confirmed are simply sent again and confirmed anew.
                log.info("an acknowledgement expired while this agent was away; its reports will be re-sent")
            else:
                self.command_refused(refused)
            self.command_ack(command)
            return
        try:
            if verified.task == LAUNCH:
                self.job_launch(LaunchSpec.from_message(verified.body))
            elif verified.task == STOP:
                self.job_stop(verified.body)
            elif verified.task == REGISTER:
                self.report(R_REGISTER, {"info": self.registration()})
            elif verified.task == ACK:
                self.spool.ack(verified.body["seqs"])
        except (KeyError, TypeError, ValueError) as exc:
            log.error("malformed %s command (job %s): %s", verified.task, verified.job_id, exc)
        self.command_ack(command)

    def command_ack(self, command: Command) -> None:
        """Acknowledge a handled command. A broker lost at this moment is an outage like any other (go
        offline, spool), not the agent's end: the broker delivers the command again after the reconnect,
        and handling it twice is safe (a launch already running or finished is ignored, a stop of a
        stopped job and an acknowledgement change nothing, and a replayed signed command is refused)."""
        try:
            command.ack()
        except Exception as exc:  # noqa: BLE001 - any broker failure: go offline, spool
            log.warning("broker connection lost acknowledging %s: %s", command.task, exc)
            self.link.disconnect()

    def command_refused(self, refused: CommandRefused) -> None:
        """Log a refused command with its reason and report it (the platform counts them per node)."""
        self.commands_refused += 1
        log.error(
            "command %r refused: %s (job %s); nothing was run", refused.task[:100], refused.reason, refused.job_id
        )
        body = {"task": refused.task[:100], "reason": refused.reason[:300], "job_id": refused.job_id}
        self.report(R_COMMAND_REFUSED, {**body, "nonce": refused.nonce[:64]})

    def report(self, task: str, kwargs: dict) -> None:
        """Queue a report for the platform: kept until the platform confirms it stored it (at least once)."""
        self.spool.put(task, kwargs)

    def _envelope(self, body: dict, seqs: list[int]) -> dict:
        """A report's kwargs: the node's credential is added here, at send time, never stored in the outbox."""
        return report_kwargs(token=self.config.token, node=self.config.node, seqs=seqs, body=body)

    def flush(self) -> None:
        """Send the reports that are due: never sent, or sent and not acknowledged for ``resend_after_s``."""
        if not self.link.connected:
            return
        rows = self.spool.due(OUTBOX_BATCH, resend_after_s=self.resend_after_s)
        i = 0
        try:
            while i < len(rows):
                batch = _batch_at(rows, i)
                ids = [r[0] for r in batch]
                task = rows[i][1]
                if task == R_USAGE:
                    # Consecutive windows travel together: one message, one bulk insert, one acknowledgement.
                    windows = [w for _, _, k, _ in batch for w in k["windows"]]
                    self.link.send(task, self._envelope({"windows": windows}, ids))
                elif len(batch) > 1:
                    # Consecutive job starts and exits too (a wave of short jobs): one message, one acknowledgement.
                    events = [{"task": t, "body": k} for _, t, k, _ in batch]
                    self.link.send(R_JOB_EVENTS, self._envelope({"events": events}, ids))
                else:
                    self.link.send(task, self._envelope(rows[i][2], ids))
                self.spool.mark_sent(ids)
                i += len(batch)
        except ProtocolError as exc:  # a body this agent built wrongly: never sendable, do not loop on it
            log.error("outbox report %s cannot be sent (%s); dropped", rows[i][0], exc)
            self.spool.remove([rows[i][0]])
        except Exception as exc:  # noqa: BLE001 - keep it in the outbox, retry on reconnect
            log.warning("could not deliver to the broker (%s); %d message(s) kept", exc, self.spool.pending())
            self.link.disconnect()
            self.next_reconnect = time.monotonic() + 1.0

    # --- jobs --------------------------------------------------------------

    def job_launch(self, spec: LaunchSpec) -> None:
        if (spec.job_id, spec.attempt) in self.finished:
            log.info("job %s attempt %s already ran here; launch ignored", spec.job_id, spec.attempt)
            return
        current = self.jobs.get(spec.job_id)
        if current is not None:
            if current.spec.attempt == spec.attempt:
                return  # a redelivered launch: already running
            # The platform gave up on the old attempt: stop it, start the new one once it is gone
            # (and off its GPUs), so one job never runs twice here.
            current.request_stop(reason="superseded by a newer attempt", grace_s=spec.grace_s)
            self.deferred[spec.job_id] = spec
            log.info("job %s attempt %s waits for attempt %s to end", spec.job_id, spec.attempt, current.spec.attempt)
            return
        unknown = [u for u in spec.gpu_uuids if u not in self.gpus]
        if unknown:
            self._launch_refused(spec, f"node has no GPU {', '.join(unknown)}")
            return
        refused = self._launch_check(spec)
        if refused:
            self._launch_refused(spec, refused)
            return
        try:
            uid = self.pool.acquire() if self.pool is not None else None
        except IsolationError as exc:
            self._launch_refused(spec, str(exc))
            return
        try:
            extra_env = self.backend.job_env(spec) if hasattr(self.backend, "job_env") else {}
        except Exception as exc:  # noqa: BLE001 - MIG/MPS setup failed: the job fails, the agent keeps going
            if uid is not None:
                self.pool.release(uid)
            self._launch_refused(spec, f"could not set up the GPU slice: {exc}")
            return
        owner = (uid, uid) if uid is not None else self.run_as
        name = f"{spec.job_id}-{spec.attempt}"
        workdir = workdir_make(self.jobs_dir / name, owner=owner)
        drop = Drop(
            uid=owner[0] if owner else None,
            gid=owner[1] if owner else None,
            nproc=self.config.job_nproc if uid is not None else 0,
            nofile=self.config.job_nofile,
        )
        job = launch(
            spec,
            workdir=workdir,
            log_path=self.logs_dir / f"{name}.log",
            agent_env=dict(os.environ),
            env_allow=self.config.env_allow,
            extra_env=extra_env,
            log_cap=self.config.log_cap_bytes,
            drop=drop,
            docker=(docker_binary(self.config.docker) or self.config.docker) if spec.image else "",
            docker_options=DockerOptions(pids_limit=self.config.docker_pids_limit, network=self.config.docker_network),
            env_file=self.env_dir / f"{name}.env" if spec.image else None,
            cgroup_root=self.cgroup_root,
            jobexec=self.jobexec,
        )
        job.uid = uid
        self.jobs[spec.job_id] = job
        self.meters[spec.job_id] = JobMeter(
            job_id=spec.job_id,
            attempt=spec.attempt,
            start_ms=job.started_ms,
            window_ms=int(self.config.window_s * 1000),
        )
        if job.pgid > 0:
            self.spool.job_record(job_id=spec.job_id, attempt=spec.attempt, pgid=job.pgid, started_ms=job.started_ms)
        self.report("agents.job_started", {"job_id": spec.job_id, "attempt": spec.attempt, "at_ms": job.started_ms})
        log.info("job %s attempt %s started on %s", spec.job_id, spec.attempt, spec.gpu_uuids or "no GPU")

    def _launch_check(self, spec: LaunchSpec) -> str:
        """Why this node will not start the job, or "" (the API checked too: this is the node's own word)."""
        if spec.image:
            problem = image_check(spec.image, self.config.allowed_registries)
            if problem:
                return f"image refused: {problem}"
            problem = env_file_problem(spec.env)
            if problem:
                return problem
            if not docker_available(self.config.docker):
                return f"job asks for image {spec.image!r} but no docker engine answers on this node"
            if self.multi_tenant:
                return self._container_network_problem()
        return ""

    def _container_network_problem(self) -> str:
        """:func:`container_network_problem` for the node's container network, asked again after a minute."""
        checked_at, problem = self.container_network_checked
        if time.monotonic() - checked_at > 60:
            problem = container_network_problem(self.config.docker, self.config.docker_network)
            self.container_network_checked = (time.monotonic(), problem)
            if problem:
                log.error("container jobs refused on this multi-tenant node: %s", problem)
        return problem

    def _workdir_remove(self, path: Path, uid: int | None) -> None:
        shutil.rmtree(path, ignore_errors=True)
        self.workdir_expiry.pop(path, None)
        if uid is not None and self.pool is not None:
            self.pool.release(uid)

    def _launch_refused(self, spec: LaunchSpec, reason: str) -> None:
        """Report a job that could not start as started and failed at once, with ``reason``."""
        log.error("job %s attempt %s not started: %s", spec.job_id, spec.attempt, reason)
        at = now_ms()
        self.report("agents.job_started", {"job_id": spec.job_id, "attempt": spec.attempt, "at_ms": at})
        self.report(
            "agents.job_exited",
            {"job_id": spec.job_id, "attempt": spec.attempt, "exit_code": None, "at_ms": at + 1, "reason": reason},
        )

    def job_stop(self, payload: dict) -> None:
        job_id = int(payload["job_id"])
        job = self.jobs.get(job_id)
        attempt = payload.get("attempt")
        if job is None or (attempt is not None and int(attempt) != job.spec.attempt):
            log.info("stop for job %s which is not running here", job_id)
            if attempt is not None:
                self.report(
                    "agents.job_exited",
                    {
                        "job_id": job_id,
                        "attempt": int(attempt),
                        "exit_code": None,
                        "at_ms": now_ms(),
                        "reason": "not running on this node",
                        "lost": True,
                    },
                )
            return
        job.request_stop(reason=str(payload.get("reason", "stopped")), grace_s=int(payload.get("grace_s", 30)))

    def reap(self) -> None:
        """Finish jobs whose processes are all gone (and off the GPU)."""
        for job in list(self.jobs.values()):
            job.enforce()
            if not job.poll():
                continue
            if job.ended_ms is None:
                job.ended_ms = now_ms()
                job.signal_group(signal.SIGKILL)  # the main process ended: so does the job
                if job.uid is not None and not job.container:
                    uid_kill_all(job.uid)  # its escaped processes too: everything that runs as its uid
            if job.running():
                continue
            if not self._off_gpu(job):
                continue
            self.job_finish(job)

    def _gpu_pids_unclaimed(self, running: list[RunningJob]) -> set[int]:
        """Processes the driver shows on a running job's GPU that no job's pids hold (only when a
        job has a cgroup to look them up in)."""
        if not any(job.cgroup is not None for job in running):
            return set()
        seen: set[int] = set()
        for uuid in {u for job in running for u in job.spec.gpu_uuids}:
            seen |= self.backend.pids_on_gpu(uuid) or set()
        return seen.difference(*(job.pids for job in running))

    def _off_gpu(self, job: RunningJob) -> bool:
        for uuid in job.spec.gpu_uuids:
            seen = self.backend.pids_on_gpu(uuid)
            if seen and seen & job.pids:
                return False
        return True

    def job_finish(self, job: RunningJob) -> None:
        spec = job.spec
        self.finished.append((spec.job_id, spec.attempt))
        if job.log_capture is not None:
            job.log_capture.join(timeout=2)
        meter = self.meters.pop(spec.job_id)
        window = meter.close(job.ended_ms)
        self.ship_logs(job, everything=True)
        reason = job.stop_reason
        if job.log_capture is not None and job.log_capture.truncated:
            reason = (reason + "; " if reason else "") + "log output was capped"
        self.report(
            "agents.job_exited",
            {
                "job_id": spec.job_id,
                "attempt": spec.attempt,
                "exit_code": None if job.stop_lost else job.exit_code,
                "at_ms": job.ended_ms,
                "reason": reason,
                "lost": job.stop_lost,
                # The last window travels with the exit, so the platform stores it
                # before the job reads as finished (never a finished job missing cost).
                "windows": [window.as_dict()] if window is not None else [],
            },
        )
        self.spool.job_forget(job_id=spec.job_id, attempt=spec.attempt)
        del self.jobs[spec.job_id]
        if job.cgroup is not None:
            job.cgroup.remove()
        if job.env_file is not None:
            job.env_file.unlink(missing_ok=True)
        # The work dir goes once the output is shipped (it is in the agent's own log file), unless the
        # operator keeps finished ones for a while; the job's uid stays reserved while its files exist.
        keep_s = self.config.keep_workdir_min * 60
        if keep_s > 0:
            self.workdir_expiry[job.workdir] = (time.monotonic() + keep_s, job.uid)
        else:
            self._workdir_remove(job.workdir, job.uid)
        if hasattr(self.backend, "job_ended"):
            self.backend.job_ended(spec)
        log.info("job %s attempt %s ended: exit %s %s", spec.job_id, spec.attempt, job.exit_code, reason)
        if (newer := self.deferred.pop(spec.job_id, None)) is not None and not self.stopping:
            self.job_launch(newer)

    def ship_logs(self, job: RunningJob, *, everything: bool = False) -> None:
        try:
            size = job.log_path.stat().st_size
        except FileNotFoundError:
            return
        chunks = 0
        with open(job.log_path, "rb") as source:
            while job.log_shipped < size and (everything or chunks < 4):
                source.seek(job.log_shipped)
                data = source.read(LOG_CHUNK)
                if not data:
                    break
                self.report(
                    "agents.logs",
                    {
                        "job_id": job.spec.job_id,
                        "offset": job.log_shipped,
                        "data_b64": base64.b64encode(data).decode(),
                    },
                )
                job.log_shipped += len(data)
                chunks += 1

    # --- sampling ------------------------------------------------------------

    def tick(self) -> None:
        at = now_ms()
        groups = process_groups()
        running = [j for j in self.jobs.values() if j.ended_ms is None and j.exit_code is None]
        for job in running:
            job.refresh_pids(groups)
        if stray := self._gpu_pids_unclaimed(running):
            # NVML reports host pids: one that no job's tree held at the read above (a container's
            # process started since) is its job's when its cgroup lies under the job's.
            cgroups = {pid: cgroup for pid in stray if (cgroup := pid_cgroup(pid)) is not None}
            for job in running:
                job.claim(cgroups)
        samples = self.backend.sample(
            [JobProcesses(j.spec.job_id, tuple(j.spec.gpu_uuids), j.pids, j.spec.share_milli) for j in running]
        )
        energy_by_job: dict[int, float] = {}
        for uuid, sample in samples.items():
            previous = self.energy_prev.get(uuid)
            if sample.energy_mj is not None:
                self.energy_prev[uuid] = sample.energy_mj
            delta = (sample.energy_mj - previous) if previous is not None and sample.energy_mj is not None else 0
            holders = {j.spec.job_id: j for j in running if uuid in j.spec.gpu_uuids}
            if not holders:
                continue
            weights = {job_id: (sample.jobs[job_id].sm_util if job_id in sample.jobs else 0.0) for job_id in holders}
            if not any(weights.values()):
                weights = {job_id: float(job.spec.share_milli) for job_id, job in holders.items()}
            for job_id, part in split_energy(max(delta, 0), weights).items():
                energy_by_job[job_id] = energy_by_job.get(job_id, 0.0) + part
        for job in running:
            use = [samples[u].jobs.get(job.spec.job_id) for u in job.spec.gpu_uuids if u in samples]
            sm = sum(u.sm_util for u in use if u)
            memory = sum(u.memory_mb for u in use if u)
            window = self.meters[job.spec.job_id].add(
                at_ms=at, sm_util_pct=sm, memory_mb=memory, energy_mj=energy_by_job.get(job.spec.job_id, 0.0)
            )
            if window is not None:
                self.report("agents.usage", {"windows": [window.as_dict()]})
            self.ship_logs(job)
            self._enforce_memory(job, use)
            self._enforce_disk(job)
        if self.netpolicy is not None:
            self.netpolicy.own_ports_sync({j.uid for j in running if j.uid is not None})
        for path, (at, uid) in list(self.workdir_expiry.items()):
            if time.monotonic() >= at:
                self._workdir_remove(path, uid)
        self.last_metrics = {uuid: s.metrics() for uuid, s in samples.items()}
        self.metrics.observe(samples=samples, running=running, energy_mj=energy_by_job)
        for uuid, sample in samples.items():
            for event in sample.health_events:
                self.health_event(uuid, event)
        if time.monotonic() >= self.next_heartbeat:
            self.next_heartbeat = time.monotonic() + self.config.heartbeat_s
            self.heartbeat(at)

    def health_event(self, uuid: str, event: dict) -> None:
        """Stop the jobs on a GPU that raised an error, and tell the platform.

        An application XID ends the job(s) on that GPU (the event does not say
        which process caused it; on a shared GPU the fault domain is shared
        anyway); a hardware event ends them too, and the platform takes the
        GPU out of service.
        """
        description = event_describe(event)
        affected = []
        if event_is_application_error(event) or event_takes_gpu_out(event):
            for job in self.jobs.values():
                if uuid in job.spec.gpu_uuids and job.term_sent_at is None:
                    job.request_stop(reason=f"{description} on GPU {uuid}", grace_s=job.spec.grace_s)
                    affected.append({"job_id": job.spec.job_id, "attempt": job.spec.attempt})
        log.warning("GPU %s: %s (jobs stopped: %s)", uuid, description, [a["job_id"] for a in affected] or "none")
        self.report("agents.gpu_health", {"uuid": uuid, "event": event, "jobs": affected, "at_ms": now_ms()})

    def _enforce_memory(self, job: RunningJob, use) -> None:
        """A shared slice that holds more GPU memory than its share is stopped."""
        if job.spec.share_milli >= 1000 or job.term_sent_at is not None:
            return
        for uuid, u in zip(job.spec.gpu_uuids, use, strict=False):
            gpu = self.gpus.get(uuid)
            limit = gpu.memory_mb * job.spec.share_milli // 1000 if gpu else 0
            if u and gpu and getattr(self.backend, "enforces_memory", False) and u.memory_mb > limit:
                reason = f"GPU memory {u.memory_mb} MiB exceeds the slice's {limit} MiB"
                log.warning("stopping job %s: %s", job.spec.job_id, reason)
                job.request_stop(reason=reason, grace_s=job.spec.grace_s)
                return

    def _enforce_disk(self, job: RunningJob) -> None:
        """A job whose work dir grows past ``--job-disk-mb`` is stopped, and told why."""
        limit = self.config.job_disk_mb << 20
        if not limit or job.term_sent_at is not None or time.monotonic() < job.next_disk_check:
            return
        job.next_disk_check = time.monotonic() + self.config.disk_check_s
        used = disk_usage_bytes(job.workdir, stop_at=limit)
        if used > limit:
            reason = f"disk use of its work dir passed the job's bound of {self.config.job_disk_mb} MiB"
            log.warning("stopping job %s: %s", job.spec.job_id, reason)
            job.request_stop(reason=reason, grace_s=job.spec.grace_s)

    def heartbeat(self, at_ms: int) -> None:
        if not self.link.connected:
            return
        body = {"at_ms": at_ms, "gpus": [{"uuid": uuid, "metrics": m} for uuid, m in self.last_metrics.items()]}
        try:
            self.link.send(R_HEARTBEAT, self._envelope(body, []))  # not spooled: the next one replaces it
        except Exception as exc:  # noqa: BLE001
            log.warning("heartbeat not delivered: %s", exc)
            self.link.disconnect()


def main(argv: list[str] | None = None) -> None:
    os.umask(0o077)  # everything the agent writes (outbox, logs, env files) is its own
    config = parse_args(argv)
    # The agent's secrets leave the environment before anything is forked: no child inherits them,
    # and /proc/<agent>/environ no longer shows them (sandbox.secret_from_env).
    for name in ("GPUSHARE_AGENT_TOKEN", "GPUSHARE_METRICS_TOKEN"):
        secret_from_env(name)
    backend = backend_for(config)
    url, options = broker_options(config.broker_url, config.var_dir, node=config.node)
    link = BrokerLink(url=url, transport_options=options, node_name=config.node)
    private_dir(config.state_dir.parent)
    private_dir(config.state_dir)
    spool = Spool(config.state_dir / "state.sqlite3")
    try:
        Agent(config, backend, link, spool, verifier=verifier_from_env(config.node, spool)).run()
    except IsolationError as exc:
        log.error("%s", exc)
        raise SystemExit(f"gpushare-agent: {exc}") from exc


def verifier_from_env(node: str, spool: Spool) -> CommandVerifier:
    """The platform's public keys, from ``GPUSHARE_NODELINK_PUBLIC_KEYS`` (``ed25519:...``, comma-separated)
    or the file ``GPUSHARE_NODELINK_PUBLIC_KEY_FILE`` (one per line): what ``manage.py nodelink_keygen --public``
    prints. Without one the agent refuses to start: it would have to refuse every command."""
    text = os.environ.get("GPUSHARE_NODELINK_PUBLIC_KEYS", "")
    path = os.environ.get("GPUSHARE_NODELINK_PUBLIC_KEY_FILE", "")
    try:
        if path:
            with open(path) as source:
                text += "\n" + source.read()
        keys = public_keys_load(text)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"gpushare-agent: cannot load the platform's public keys: {exc}") from exc
    if not keys:
        raise SystemExit(
            "gpushare-agent: no platform public key: set GPUSHARE_NODELINK_PUBLIC_KEY_FILE (or "
            "GPUSHARE_NODELINK_PUBLIC_KEYS) to what `manage.py nodelink_keygen --public` prints"
        )
    skew = int(os.environ.get("GPUSHARE_NODELINK_CLOCK_SKEW_MS", "30000"))
    return CommandVerifier(node, keys, spool.nonce_seen, skew_ms=skew)


if __name__ == "__main__":
    main(sys.argv[1:])
