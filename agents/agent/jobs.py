"""Running one job's processes on the node: environment, pinning, logs, stopping."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from .cgroups import JobCgroup
from .jobexec import environment_file, jobexec_argv
from .sandbox import Drop

log = logging.getLogger(__name__)

# Variables the agent copies from its own environment into a job's; nothing
# else of the agent's (broker URL, credentials) ever reaches a job.
DEFAULT_ENV_ALLOW = ("PATH", "LANG", "LC_ALL", "TZ")
RESERVED_PREFIXES = ("CUDA_", "NVIDIA_", "GPUSHARE_", "LD_", "DOCKER_", "GCONV_PATH", "GLIBC_TUNABLES")


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True)
class LaunchSpec:
    job_id: int
    attempt: int
    command: list[str]
    env: dict[str, str]
    gpu_uuids: list[str]
    share_milli: int
    mode: str
    max_runtime_s: int
    grace_s: int
    tenant: str = ""
    image: str = ""
    array: dict = field(default_factory=dict)  # a job array's task: {"id", "index", "count"}

    @classmethod
    def from_message(cls, payload: dict) -> LaunchSpec:
        return cls(
            job_id=int(payload["job_id"]),
            attempt=int(payload.get("attempt", 1)),
            command=[str(a) for a in payload["command"]],
            env={str(k): str(v) for k, v in (payload.get("env") or {}).items()},
            gpu_uuids=[str(u) for u in payload.get("gpu_uuids") or []],
            share_milli=int(payload.get("share_milli", 1000)),
            mode=str(payload.get("mode", "dedicated")),
            max_runtime_s=int(payload.get("max_runtime_s", 86400)),
            grace_s=int(payload.get("grace_s", 30)),
            tenant=str(payload.get("tenant", "")),
            image=str(payload.get("image", "")),
            array={k: int(v) for k, v in (payload.get("array") or {}).items() if k in ("id", "index", "count")},
        )


def job_environment(
    spec: LaunchSpec, *, workdir: Path, agent_env: dict[str, str], allow: tuple[str, ...], extra: dict[str, str]
) -> dict[str, str]:
    """The job's whole environment: allow-listed agent variables, the job's own
    (minus reserved names), then the pinning the platform decided."""
    env = {k: agent_env[k] for k in allow if k in agent_env}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.setdefault("LANG", "C.UTF-8")
    env["HOME"] = str(workdir)
    env["TMPDIR"] = str(workdir / "tmp")
    env["PYTHONUNBUFFERED"] = "1"
    for key, value in spec.env.items():
        if not key.upper().startswith(RESERVED_PREFIXES):
            env[key] = value
    devices = ",".join(spec.gpu_uuids)
    # An empty CUDA_VISIBLE_DEVICES hides every GPU; unset would show them all.
    env["CUDA_VISIBLE_DEVICES"] = devices
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env["NVIDIA_VISIBLE_DEVICES"] = devices or "void"
    env["GPUSHARE_JOB_ID"] = str(spec.job_id)
    env["GPUSHARE_ATTEMPT"] = str(spec.attempt)
    env["GPUSHARE_GRACE_SECONDS"] = str(spec.grace_s)
    env["GPUSHARE_GPU_FRACTION"] = f"{spec.share_milli / 1000:g}"
    for key, name in (
        ("id", "GPUSHARE_ARRAY_ID"),
        ("index", "GPUSHARE_ARRAY_INDEX"),
        ("count", "GPUSHARE_ARRAY_COUNT"),
    ):
        if key in spec.array:
            env[name] = str(spec.array[key])
    env.update(extra)
    return env


# The docker CLI runs as root with this environment, never the job's: DOCKER_HOST, DOCKER_CONFIG,
# PATH or LD_PRELOAD of a tenant cannot steer it. The operator's own DOCKER_* (the agent's
# environment) still apply.
DOCKER_CLI_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
DOCKER_OPERATOR_VARS = (
    "HOME",
    "DOCKER_HOST",
    "DOCKER_CONFIG",
    "DOCKER_CONTEXT",
    "DOCKER_TLS_VERIFY",
    "DOCKER_CERT_PATH",
)


def docker_cli_env(agent_env: dict[str, str]) -> dict[str, str]:
    """The fixed environment the docker CLI runs with (the operator's docker settings, nothing of a job's)."""
    return {**DOCKER_CLI_ENV, **{k: agent_env[k] for k in DOCKER_OPERATOR_VARS if k in agent_env}}


def docker_binary(docker: str) -> str | None:
    """The docker CLI by absolute path, found on the fixed PATH (never a job's)."""
    if not docker:
        return None
    if os.path.isabs(docker):
        return docker if os.access(docker, os.X_OK) else None
    return shutil.which(docker, path=DOCKER_CLI_ENV["PATH"])


def docker_cli(docker: str, *args: str) -> subprocess.CompletedProcess | str:
    """Run the docker CLI (found on the fixed PATH, with the fixed environment): its result, or why it
    could not run."""
    exe = docker_binary(docker)
    if exe is None:
        return f"no docker CLI {docker!r}"
    try:
        return subprocess.run(
            [exe, *args], capture_output=True, text=True, timeout=15, check=False, env=docker_cli_env(dict(os.environ))
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)


def docker_available(docker: str) -> bool:
    """Whether a docker CLI is installed and its engine answers."""
    result = docker_cli(docker, "version", "--format", "{{.Server.Version}}")
    return not isinstance(result, str) and result.returncode == 0


ICC_OPTION = "com.docker.network.bridge.enable_icc"


def container_network_problem(docker: str, network: str) -> str:
    """Why containers on ``network`` could reach each other's ports (a multi-tenant node refuses
    to start containers there), or "". Bridged traffic between two containers never passes the
    host's firewall, so the node's table cannot stop it: the bridge itself must forbid it
    (``"icc": false`` in daemon.json for the default bridge, ``-o <ICC_OPTION>=false`` for another).
    ``none`` has no network; ``host`` shares the node's, where the table's per-uid rules apply."""
    name = network or "bridge"
    if name in ("none", "host"):
        return ""
    template = '{{.Driver}} {{index .Options "' + ICC_OPTION + '"}}'
    result = docker_cli(docker, "network", "inspect", "--format", template, "--", name)
    if isinstance(result, str):
        return f"could not inspect docker network {name!r}: {result}"
    if result.returncode != 0:
        return f"could not inspect docker network {name!r}: {result.stderr.strip()[:200]}"
    driver, _, icc = result.stdout.strip().partition(" ")
    if driver != "bridge":
        return f"docker network {name!r} uses the {driver!r} driver; a multi-tenant node runs containers on a bridge"
    if icc != "false":
        fix = '"icc": false in /etc/docker/daemon.json' if name == "bridge" else f"-o {ICC_OPTION}=false"
        return (
            f"docker network {name!r} lets containers reach each other (inter-container communication is on): "
            f"another tenant's container could connect to this one; recreate it with {fix}"
        )
    return ""


def container_name(spec: LaunchSpec) -> str:
    return f"gpushare-job-{spec.job_id}-{spec.attempt}"


def env_file_lines(env: dict[str, str]) -> str:
    """``--env-file`` content. Its format has no quoting: a value with a newline would smuggle in
    another variable, so such a job is refused (``env_file_problem``) before this is written."""
    return "".join(f"{key}={value}\n" for key, value in sorted(env.items()) if key not in ("PATH", "HOME", "TMPDIR"))


def env_file_problem(env: dict[str, str]) -> str:
    bad = sorted(k for k, v in env.items() if "\n" in v or "\r" in v or "\0" in v or "\n" in k or "=" in k)
    return f"variables {', '.join(bad)} hold a line break, which an image job's env file cannot carry" if bad else ""


@dataclass(frozen=True)
class DockerOptions:
    pids_limit: int = 4096
    network: str = ""  # "": docker's default bridge


def docker_argv(
    spec: LaunchSpec,
    *,
    docker: str,
    env_file: Path | None = None,
    workdir: Path,
    run_as=None,
    options: DockerOptions | None = None,
    cgroup_parent: str = "",
) -> list[str]:
    """``docker run`` for a job: its GPUs by UUID, its environment through a 0600 env file (never
    on argv, never in the CLI's own environment), its workdir at /job, no capabilities, no new
    privileges, a pids limit, the job's uid, the job's cgroup as the container's parent, and
    ``--`` before the (validated) image."""
    options = options or DockerOptions()
    argv = [docker, "run", "--rm", "--init", "--name", container_name(spec), "-v", f"{workdir}:/job", "-w", "/job"]
    argv += ["--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--pids-limit", str(options.pids_limit)]
    argv += ["-e", "HOME=/job", "-e", "TMPDIR=/job/tmp"]
    if spec.gpu_uuids:
        argv += ["--gpus", f'"device={",".join(spec.gpu_uuids)}"']
    if run_as is not None:
        argv += ["--user", f"{run_as[0]}:{run_as[1]}"]
    if options.network:
        argv += ["--network", options.network]
    if cgroup_parent:
        argv += ["--cgroup-parent", cgroup_parent]
    if env_file is not None:
        argv += ["--env-file", str(env_file)]
    return [*argv, "--", spec.image, *spec.command]


class LogCapture(threading.Thread):
    """Copies a job's output pipe to its log file, up to ``cap`` bytes."""

    def __init__(self, pipe, path: Path, cap: int):
        super().__init__(daemon=True, name=f"log-{path.parent.name}")
        self.pipe = pipe
        self.path = path
        self.cap = cap
        self.written = 0
        self.truncated = False

    def run(self) -> None:
        with open(os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab") as out:
            while chunk := self.pipe.read1(65536) if hasattr(self.pipe, "read1") else self.pipe.read(65536):
                room = self.cap - self.written
                if room > 0:
                    piece = chunk[:room]
                    out.write(piece)
                    out.flush()
                    self.written += len(piece)
                if len(chunk) > max(room, 0) and not self.truncated:
                    self.truncated = True
                    note = f"\n[gpushare: log capped at {self.cap} bytes; further output discarded]\n".encode()
                    out.write(note)
                    out.flush()
                    self.written += len(note)
        self.pipe.close()


@dataclass
class RunningJob:
    spec: LaunchSpec
    proc: subprocess.Popen | None
    pgid: int
    started_ms: int
    workdir: Path
    log_path: Path
    log_capture: LogCapture | None = None
    log_shipped: int = 0
    stop_reason: str = ""
    stop_lost: bool = False  # report the job lost (agent shutting down), not exited
    term_sent_at: float | None = None
    kill_at: float | None = None
    exit_code: int | None = None
    ended_ms: int | None = None
    adopted: bool = False
    pids: frozenset[int] = field(default_factory=frozenset)
    container: str = ""  # docker runtime: the container to kill when the grace period ends
    docker: str = ""
    cgroup: JobCgroup | None = None
    uid: int | None = None  # the job's own pool uid (multi-tenant)
    env_file: Path | None = None
    next_disk_check: float = 0.0

    @property
    def deadline(self) -> float:
        return self.started_ms / 1000 + self.spec.max_runtime_s

    def group_alive(self) -> bool:
        if self.cgroup is not None and self.cgroup.pids():
            return True
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def poll(self) -> bool:
        """True once the job's main process has ended (records its exit)."""
        if self.exit_code is not None or self.ended_ms is not None:
            return True
        if self.proc is None:
            return not self.group_alive()
        code = self.proc.poll()
        if code is None:
            return False
        self.exit_code = code if code >= 0 else 128 - code
        return True

    def signal_group(self, sig: int) -> None:
        if self.cgroup is not None:
            if sig == signal.SIGKILL:
                self.cgroup.kill()
            else:
                for pid in self.cgroup.pids():
                    try:
                        os.kill(pid, sig)
                    except (ProcessLookupError, PermissionError):
                        pass
        try:
            os.killpg(self.pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def running(self) -> bool:
        """Whether any process of the job is left: its cgroup's, or else (and for an image job, whose
        ``docker run`` client is outside the container's cgroup, also) its process group's."""
        if self.cgroup is not None and self.cgroup.pids():
            return True
        if self.cgroup is not None and not self.container:
            return False
        return self.pgid > 0 and group_running(self.pgid)

    def request_stop(self, *, reason: str, grace_s: int, lost: bool = False) -> None:
        """SIGTERM the whole job now, SIGKILL it after ``grace_s``."""
        if self.term_sent_at is not None:
            self.kill_at = min(self.kill_at or float("inf"), time.monotonic() + grace_s)
            return
        self.stop_reason = reason
        self.stop_lost = lost
        self.term_sent_at = time.monotonic()
        self.kill_at = self.term_sent_at + grace_s
        self.signal_group(signal.SIGTERM)

    def enforce(self) -> None:
        """Escalate a stop whose grace period ran out; stop a job past its max runtime."""
        if self.term_sent_at is None and time.time() >= self.deadline:
            self.request_stop(reason=f"max runtime of {self.spec.max_runtime_s} s reached", grace_s=self.spec.grace_s)
        if self.kill_at is not None and time.monotonic() >= self.kill_at:
            if self.container and self.proc is not None and self.proc.poll() is None:
                subprocess.run([self.docker, "kill", self.container], capture_output=True, timeout=15, check=False)
            self.signal_group(signal.SIGKILL)

    def refresh_pids(self, groups: dict[int, list[int]] | None = None) -> frozenset[int]:
        """The job's processes: its process group, plus its cgroup subtree's (which also holds
        escapees, and an image job's container)."""
        in_group = (groups or {}).get(self.pgid) if groups is not None else None
        if in_group is None:
            in_group = [p for p in psutil.pids() if _pgid(p) == self.pgid]
        self.pids = frozenset(in_group) | frozenset(self.cgroup.pids() if self.cgroup else ())
        return self.pids

    def claim(self, cgroups: dict[int, str]) -> frozenset[int]:
        """Add the processes of ``cgroups`` (pid -> its ``pid_cgroup``) that lie in the job's cgroup subtree."""
        if self.cgroup is not None:
            self.pids |= {pid for pid, cgroup in cgroups.items() if self.cgroup.holds(cgroup)}
        return self.pids


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def launch(
    spec: LaunchSpec,
    *,
    workdir: Path,
    log_path: Path,
    agent_env: dict[str, str],
    env_allow: tuple[str, ...],
    extra_env: dict[str, str],
    log_cap: int,
    drop: Drop,
    docker: str = "",
    docker_options: DockerOptions | None = None,
    env_file: Path | None = None,
    cgroup_root: Path | None = None,
    jobexec: Path | None = None,
) -> RunningJob:
    """Start the job's command in its own session (process group); with
    ``docker``, start ``docker run`` of the job's image instead.

    ``workdir`` already exists, private to the job (``sandbox.workdir_make``).
    The child joins the job's cgroup, drops to the job's uid and sets
    ``no_new_privs`` before ``execve``: in the launch helper ``jobexec`` when
    given (``jobexec.py``: the same steps in C), else in this process's own
    code (``sandbox.Drop``); the job's environment reaches only the job's program.
    """
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.close(log_fd)
    env = job_environment(spec, workdir=workdir, agent_env=agent_env, allow=env_allow, extra=extra_env)
    argv = spec.command
    run_as = (drop.uid, drop.gid) if drop.uid is not None else None
    cgroup = JobCgroup.create(cgroup_root, f"{spec.job_id}-{spec.attempt}") if cgroup_root is not None else None
    if docker:
        # The CLI stays root (it talks to the engine) and outside the job's cgroup; the container
        # runs as the job's uid, in a cgroup the engine makes below the job's (cgroupfs driver).
        if cgroup is not None and cgroup.relative is None:
            log.warning("%s is not on the cgroup v2 mount: job %s's container is not in it", cgroup.path, spec.job_id)
            cgroup.remove()
            cgroup = None
        fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with open(fd, "w") as out:
            out.write(env_file_lines(env))
        argv = docker_argv(
            spec,
            docker=docker,
            env_file=env_file,
            workdir=workdir,
            run_as=run_as,
            options=docker_options,
            cgroup_parent=cgroup.relative if cgroup is not None else "",
        )
        env = docker_cli_env(agent_env)
        drop = Drop(uid=None, nofile=drop.nofile)
    elif cgroup is not None:
        drop = Drop(
            uid=drop.uid,
            gid=drop.gid,
            cgroup_procs=str(cgroup.path / "cgroup.procs"),
            nproc=drop.nproc,
            nofile=drop.nofile,
            umask=drop.umask,
        )
    started_ms = now_ms()
    env_fd = -1
    if jobexec is not None:  # the drop in the helper's C: started with vfork (jobexec.py)
        env_fd = environment_file(env)
        spawn = {"args": jobexec_argv(jobexec, env_fd=env_fd, drop=drop, argv=argv), "env": {}, "pass_fds": (env_fd,)}
    else:  # our own code in the forked child: no lock, no logging, no import (sandbox.Drop)
        spawn = {"args": argv, "env": env, "preexec_fn": drop}
    try:
        proc = subprocess.Popen(
            **spawn,
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        with open(log_path, "ab") as out:
            reason = getattr(exc, "strerror", None) or exc
            out.write(f"[gpushare: could not start {argv[0]!r}: {reason}]\n".encode())
        job = RunningJob(spec=spec, proc=None, pgid=-1, started_ms=started_ms, workdir=workdir, log_path=log_path)
        job.exit_code = 127
        job.ended_ms = started_ms + 1
        job.uid = drop.uid
        job.env_file = env_file
        if cgroup is not None:
            cgroup.remove()
        return job
    finally:
        if env_fd >= 0:
            os.close(env_fd)
    capture = LogCapture(proc.stdout, log_path, log_cap)
    capture.start()
    job = RunningJob(
        spec=spec,
        proc=proc,
        pgid=proc.pid,
        started_ms=started_ms,
        workdir=workdir,
        log_path=log_path,
        log_capture=capture,
        container=container_name(spec) if docker else "",
        docker=docker,
        cgroup=cgroup,
        uid=run_as[0] if run_as else None,
        env_file=env_file,
    )
    # A new session: the group is the child alone for now (the next tick's scan finds what it starts).
    job.refresh_pids({proc.pid: [proc.pid]})
    return job


def process_groups() -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for pid in psutil.pids():
        try:
            groups.setdefault(os.getpgid(pid), []).append(pid)
        except (ProcessLookupError, PermissionError):
            continue
    return groups


def group_running(pgid: int) -> bool:
    """Whether any non-zombie process is left in process group ``pgid``.

    A group with no process at all (how a job usually ends: its one process exited and reaped) is
    answered by one ``killpg(pgid, 0)``; only a group with a process left (a zombie counts for the
    kernel) is looked through for one that is not a zombie. Looking through every process on the
    host for each ending job cost ~5 ms a job: a third of the agent's time in a wave of short jobs."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # a process in it this agent may not signal: it is there; is it more than a zombie?
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            continue
    return False
