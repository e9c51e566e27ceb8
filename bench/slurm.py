"""A private Slurm cluster on 127.0.0.1: munged, slurmctld and slurmd.

Everything lives under one work directory (state, spool, logs, sockets, its
own munge key); nothing touches /etc/slurm or a system munged. One node
declares ``Gres=gpu:8,shard:64``; gres.conf has ``AutoDetect=off`` and
``File=`` entries pointing at plain files that stand in for /dev/nvidia0-7.

``slurm_conf()`` and ``gres_conf()`` are pure (tests/bench/test_slurm_conf.py).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")
GPUS = 8
SHARDS_PER_GPU = 8
NODE = "benchnode"
TUNED = "batch_sched_delay=0,sched_min_interval=100000,default_queue_depth=1000"
PROFILES = {"defaults": "", "tuned": TUNED}


class SlurmError(RuntimeError):
    pass


def slurm_install() -> None:
    """Install slurm-wlm and munge from Debian when missing (needs root; see bench.tools)."""
    from .tools import ToolError, apt_install

    try:
        apt_install(PACKAGES, binaries=("slurmctld", "munged", "sbatch"))
    except ToolError as exc:
        raise SlurmError(str(exc)) from exc


@dataclass(frozen=True)
class SlurmPaths:
    root: Path

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def gres(self) -> Path:
        return self.root / "etc" / "gres.conf"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket.2"

    @property
    def munge_key(self) -> Path:
        return self.root / "munge" / "munge.key"

    def dev(self, index: int) -> Path:
        return self.root / "dev" / f"nvidia{index}"


def slurm_conf(
    paths: SlurmPaths,
    *,
    hostname: str,
    user: str,
    ctld_port: int,
    slurmd_port: int,
    scheduler_parameters: str = "",
    cpus: int = GPUS * SHARDS_PER_GPU,
) -> str:
    """slurm.conf for one node with 8 GPUs and 64 shards (1 shard = 1/8 GPU).

    The node declares as many CPUs as shards so a CPU is never what limits
    how many trivial jobs run at once: the GPUs are.
    """
    r = paths.root
    lines = [
        "ClusterName=gpusharebench",
        f"SlurmctldHost={hostname}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        f"SlurmUser={user}",
        f"SlurmdUser={user}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={paths.munge_socket}",
        f"StateSaveLocation={r / 'state'}",
        f"SlurmdSpoolDir={r / 'spool'}",
        f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}",
        f"SlurmdPidFile={r / 'run' / 'slurmd.pid'}",
        f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
        "SlurmctldDebug=error",
        "SlurmdDebug=error",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/backfill",
        "GresTypes=gpu,shard",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "ReturnToService=2",
        "SlurmdParameters=config_overrides",
        "MaxJobCount=20000",
        "MinJobAge=2",
        "KillWait=5",
        "InactiveLimit=0",
        "Waittime=0",
    ]
    if scheduler_parameters:
        lines.append(f"SchedulerParameters={scheduler_parameters}")
    lines += [
        f"NodeName={NODE} NodeHostname={hostname} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000000 "
        f"Gres=gpu:{GPUS},shard:{GPUS * SHARDS_PER_GPU} State=UNKNOWN",
        f"PartitionName=bench Nodes={NODE} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
    ]
    return "\n".join(lines) + "\n"


def gres_conf(paths: SlurmPaths) -> str:
    """gres.conf: no autodetection; every GPU and its shards point at a stand-in file."""
    lines = ["AutoDetect=off"]
    for i in range(GPUS):
        lines.append(f"NodeName={NODE} Name=gpu File={paths.dev(i)}")
    for i in range(GPUS):
        lines.append(f"NodeName={NODE} Name=shard Count={SHARDS_PER_GPU} File={paths.dev(i)}")
    return "\n".join(lines) + "\n"


def gres_for_fraction(milli: int) -> str:
    """Slurm's --gres for a share of one GPU: 1000 -> gpu:1, 500 -> shard:4 ... 125 -> shard:1."""
    if milli % 1000 == 0:
        return f"gpu:{milli // 1000}"
    shards, rest = divmod(milli * SHARDS_PER_GPU, 1000)
    if rest or not 1 <= shards < SHARDS_PER_GPU:
        raise ValueError(f"{milli} thousandths of a GPU is not a whole number of 1/{SHARDS_PER_GPU} shards")
    return f"shard:{shards}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """Start/stop the private daemons; run client commands against them."""

    def __init__(self, root: Path):
        self.paths = SlurmPaths(Path(root))
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.paths.conf)}
        self.profile = ""

    def _prepare(self, scheduler_parameters: str) -> None:
        root = self.paths.root
        for sub in ("etc", "state", "spool", "run", "log", "munge", "dev", "jobs"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        (root / "munge").chmod(0o700)
        for i in range(GPUS):
            self.paths.dev(i).touch()
        if not self.paths.munge_key.exists():
            self.paths.munge_key.write_bytes(os.urandom(1024))
            self.paths.munge_key.chmod(0o400)
        import pwd

        user = pwd.getpwuid(os.geteuid()).pw_name
        self.paths.conf.write_text(
            slurm_conf(
                self.paths,
                hostname=socket.gethostname().split(".")[0],
                user=user,
                ctld_port=free_port(),
                slurmd_port=free_port(),
                scheduler_parameters=scheduler_parameters,
            )
        )
        self.paths.gres.write_text(gres_conf(self.paths))

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.paths.root / "log" / f"{name}.out", "ab")
        proc = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def start(self, profile: str = "defaults") -> None:
        slurm_install()
        self.stop()
        self.profile = profile
        self._prepare(PROFILES[profile])
        r = self.paths.root
        if not self.paths.munge_socket.exists():
            self._spawn(
                "munged",
                [
                    "munged",
                    "-F",
                    "-f",
                    f"--socket={self.paths.munge_socket}",
                    f"--key-file={self.paths.munge_key}",
                    f"--pid-file={r / 'munge' / 'munged.pid'}",
                    f"--log-file={r / 'log' / 'munged.log'}",
                    f"--seed-file={r / 'munge' / 'munged.seed'}",
                    "--num-threads=4",
                ],
            )
            self._wait(lambda: self.paths.munge_socket.exists(), 20, "munged socket")
        # -c: start clean (no jobs from an earlier profile); -i: ignore a stale state.
        self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-i", "-f", str(self.paths.conf)])
        self._spawn("slurmd", ["slurmd", "-D", "-N", NODE, "-f", str(self.paths.conf)])
        self._wait(self._node_idle, 60, "slurm node idle")

    def _node_idle(self) -> bool:
        result = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%T"], env=self.env, capture_output=True, text=True, check=False
        )
        return result.returncode == 0 and result.stdout.strip().startswith("idle")

    def _wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            for proc in self.procs:
                if proc.poll() is not None:
                    name, code = proc.args[0], proc.returncode
                    raise SlurmError(f"{name} exited ({code}) while waiting for {what}: {self.logs()}")
            time.sleep(0.2)
        raise SlurmError(f"timed out waiting for {what}: {self.logs()}")

    def logs(self) -> str:
        out = []
        for f in sorted((self.paths.root / "log").glob("*")):
            out.append(f"--- {f.name}\n{f.read_text(errors='replace')[-1500:]}")
        return "\n".join(out)

    def stop(self) -> None:
        """Stop slurmd and slurmctld (and munged, on ``stop_all``), its jobs cancelled first: a job step's
        ``slurmstepd`` outlives slurmd and would be left running on the machine."""
        if any(proc.poll() is None for proc in self.procs if proc.args[0] == "slurmctld"):
            self.cancel_all()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    if self.job_count() == 0:
                        break
                except SlurmError:
                    break
                time.sleep(0.2)
        keep = []
        for proc in self.procs:
            if proc.args[0] == "munged":
                keep.append(proc)
                continue
            _terminate(proc)
        self.procs = keep

    def stop_all(self) -> None:
        self.stop()
        for proc in self.procs:
            _terminate(proc)
        self.procs = []
        self.paths.munge_socket.unlink(missing_ok=True)

    def run(self, *argv: str, check: bool = True) -> str:
        result = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, check=False)
        if check and result.returncode != 0:
            raise SlurmError(f"{' '.join(argv)}: {result.stderr.strip()}")
        return result.stdout

    def sbatch(self, *, gres: str, command: str, hold: bool = False, array: str = "") -> int:
        argv = ["sbatch", "--parsable", "-J", "b", "-o", "/dev/null", "-c", "1", f"--gres={gres}"]
        if hold:
            argv.append("--hold")
        if array:
            argv.append(f"--array={array}")
        out = self.run(*argv, f"--chdir={self.paths.root / 'jobs'}", "--wrap", command)
        return int(out.strip().split(";")[0])

    def job_count(self) -> int:
        return len(self.run("squeue", "-h", "-o", "%i").split())

    def release(self, job_ids: list[int]) -> None:
        for i in range(0, len(job_ids), 500):
            self.run("scontrol", "release", ",".join(map(str, job_ids[i : i + 500])))

    def cancel_all(self) -> None:
        self.run("scancel", "--full", "-p", "bench", check=False)


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)
    except ProcessLookupError:
        pass
