"""A stand-in for the docker CLI *and* its engine, cgroupfs driver (no engine runs on these machines).

``docker run`` here does what Docker Engine with ``native.cgroupdriver=cgroupfs`` does to the
processes: it makes the container's cgroup ``<cgroup v2 mount>/<--cgroup-parent>/docker-<name>``
(the engine's own parent when none is given), starts the command in it, in a session of its own
(a real container's processes are the engine's children, never in the client's process group),
as the ``--user`` uid with the ``--env-file`` variables, waits for it (passing on SIGTERM, as
``docker run`` does), kills what is left in the container's cgroup when its main process ends
(its PID namespace dies with it) and removes that cgroup. ``docker kill NAME`` kills the
container's cgroup. ``docker network inspect`` answers ``STATE/network`` ("<driver> <enable_icc>",
default "bridge false"). What it was asked is recorded in ``STATE``. Not emulated: images, mounts,
namespaces, capabilities (the argv contract is checked by ``test_runtime_steering.py``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

SCRIPT = r"""#!/usr/bin/python3
import os, signal, sys, time
from pathlib import Path

MOUNT = Path("@MOUNT@")
DEFAULT_PARENT = "@DEFAULT_PARENT@"
STATE = Path("@STATE@")

args = sys.argv[1:]
if args[:1] == ["version"]:
    print("27.0.0")
    sys.exit(0)
if args[:3] == ["network", "inspect", "--format"]:  # driver and enable_icc, as the agent asks
    answer = STATE / "network"
    print(answer.read_text().strip() if answer.exists() else "bridge false")
    sys.exit(0)
if args[:1] == ["kill"]:
    (Path((STATE / (args[1] + ".cgroup")).read_text()) / "cgroup.kill").write_text("1")
    sys.exit(0)
if args[:1] != ["run"]:
    sys.exit("fake engine: only version, network inspect, run and kill")
options, (image, *command) = args[1 : args.index("--")], args[args.index("--") + 1 :]


def option(flag, default=None):
    return options[options.index(flag) + 1] if flag in options else default


name = option("--name")
cgroup = MOUNT / option("--cgroup-parent", DEFAULT_PARENT).lstrip("/") / ("docker-" + name)
cgroup.mkdir(parents=True)
(STATE / (name + ".cgroup")).write_text(str(cgroup))
(STATE / (name + ".argv")).write_text("\n".join(args))
env = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
env.update(line.split("=", 1) for line in Path(option("--env-file")).read_text().splitlines() if "=" in line)
env.update(options[i + 1].split("=", 1) for i, o in enumerate(options) if o == "-e")
pid = os.fork()
if pid == 0:
    os.setsid()
    (cgroup / "cgroup.procs").write_text(str(os.getpid()))
    if option("--user"):
        uid, gid = (int(x) for x in option("--user").split(":"))
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    os.execve(command[0], command, env)
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # docker run's --sig-proxy (on by default)
    signal.signal(sig, lambda number, _frame: os.kill(pid, number))
_, status = os.waitpid(pid, 0)
(cgroup / "cgroup.kill").write_text("1")
for _ in range(100):
    try:
        cgroup.rmdir()
        break
    except FileNotFoundError:
        break
    except OSError:
        time.sleep(0.02)
code = os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
"""


def engine_install(*, path: Path, mount: Path, default_parent: str, state: Path) -> Path:
    """Write the stand-in to ``path`` (0700, root's)."""
    text = SCRIPT.replace("@MOUNT@", str(mount)).replace("@DEFAULT_PARENT@", default_parent)
    path.write_text(text.replace("@STATE@", str(state)))
    path.chmod(0o700)
    return path


def cgroup_tree_remove(path: Path, *, timeout: float = 15) -> None:
    """Kill every process below ``path`` and remove it with its child cgroups (test cleanup)."""
    if not path.exists():
        return
    (path / "cgroup.kill").write_text("1")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            for top, _dirs, _files in os.walk(path, topdown=False):
                Path(top).rmdir()
            return
        except FileNotFoundError:
            continue
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"could not remove cgroup {path}")
