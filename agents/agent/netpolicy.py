"""Network isolation of job uids with nftables owner-match rules.

In multi-tenant mode the agent installs one table of its own, ``inet
gpushare_<node>``, at start and deletes it at shutdown. Its rules key on the
job uid pool (``meta skuid``), so they hold for every process of every job,
whatever it forks, and cost nothing for anyone else:

- a job uid opens no new connection to the node's own addresses (loopback and
  every local address: the broker, the database, the web server, the agent's
  metrics port, other jobs' ports), except DNS (port 53) and ports that the
  same uid is itself listening on (torchrun's store, a Jupyter kernel): the
  agent keeps the ``own_tcp``/``own_udp`` sets in step with ``/proc/net``;
- a job uid reaches no ``--platform-addresses`` elsewhere; with
  ``--job-egress deny`` it reaches nothing outside the node either;
- a replica port (``--replica-ports``, the platform's range) accepts new
  connections only from the node itself (the gateway; job uids were already
  stopped on their way out) and from ``--gateway-addresses``.

Replies on established connections pass, so the gateway's connection into
a replica works both ways.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("gpushare.agent")

NFT_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C"}
PROC_NET = {"tcp": ("tcp", "tcp6"), "udp": ("udp", "udp6")}


class NetPolicyError(RuntimeError):
    pass


def nft_binary() -> str | None:
    return shutil.which("nft", path=NFT_ENV["PATH"])


def table_name(node: str) -> str:
    return "gpushare_" + re.sub(r"[^a-z0-9_]", "_", node.lower())[:40]


def _addresses(cidrs: list[str], version: int) -> list[str]:
    return [c for c in cidrs if ipaddress.ip_network(c, strict=False).version == version]


@dataclass
class NetPolicy:
    node: str
    uid_first: int
    uid_last: int
    replica_ports: tuple[int, int] = (20000, 29999)
    gateways: list[str] = field(default_factory=list)  # CIDRs allowed into replica ports besides the node itself
    platform: list[str] = field(default_factory=list)  # CIDRs no job may reach (the broker, the database...)
    egress: str = "allow"  # allow | deny: new connections from jobs to the outside world
    nft: str = ""
    _own: tuple[frozenset, frozenset] = (frozenset(), frozenset())

    @property
    def table(self) -> str:
        return table_name(self.node)

    def ruleset(self) -> str:
        pool = f"{self.uid_first}-{self.uid_last}"
        low, high = self.replica_ports

        def addr_set(name: str, kind: str, cidrs: list[str]) -> str:
            elements = f" elements = {{ {', '.join(cidrs)} }};" if cidrs else ""
            return f"  set {name} {{ type {kind}; flags interval;{elements} }}"

        egress = (
            "    meta l4proto { tcp, udp } th dport 53 accept\n    counter reject\n" if self.egress == "deny" else ""
        )
        return f"""table inet {self.table} {{
  set own_tcp {{ type inet_service . uid; }}
  set own_udp {{ type inet_service . uid; }}
{addr_set("platform4", "ipv4_addr", _addresses(self.platform, 4))}
{addr_set("platform6", "ipv6_addr", _addresses(self.platform, 6))}
{addr_set("gateways4", "ipv4_addr", _addresses(self.gateways, 4))}
{addr_set("gateways6", "ipv6_addr", _addresses(self.gateways, 6))}
  chain output {{
    type filter hook output priority filter; policy accept;
    meta skuid != {pool} accept
    ct state established,related accept
    fib daddr type local jump job_to_node
    ip daddr @platform4 counter reject
    ip6 daddr @platform6 counter reject
{egress}  }}
  chain job_to_node {{
    meta l4proto {{ tcp, udp }} th dport 53 accept
    tcp dport . meta skuid @own_tcp accept
    udp dport . meta skuid @own_udp accept
    counter drop
  }}
  chain input {{
    type filter hook input priority filter; policy accept;
    tcp dport {low}-{high} jump into_replica
    iifname "docker0" ct state new fib daddr type local jump container_to_node
    iifname "br-*" ct state new fib daddr type local jump container_to_node
  }}
  chain into_replica {{
    ct state established,related accept
    fib saddr type local accept
    ip saddr @gateways4 accept
    ip6 saddr @gateways6 accept
    counter drop
  }}
  chain container_to_node {{
    meta l4proto {{ tcp, udp }} th dport 53 accept
    counter drop
  }}
}}
"""

    def _run(self, script: str) -> None:
        result = subprocess.run(
            [self.nft, "-f", "-"], input=script, text=True, capture_output=True, env=NFT_ENV, timeout=20, check=False
        )
        if result.returncode != 0:
            raise NetPolicyError(f"nft failed: {result.stderr.strip()[:500]}")

    def install(self) -> None:
        self.nft = self.nft or nft_binary() or ""
        if not self.nft:
            raise NetPolicyError("nftables (the nft command) is not installed")
        # Replace, never append: an earlier run's table (killed agent) goes first.
        self._run(f"table inet {self.table} {{}}\ndelete table inet {self.table}\n{self.ruleset()}")
        self._own = (frozenset(), frozenset())
        log.info("network policy: nft table inet %s for job uids %s-%s", self.table, self.uid_first, self.uid_last)

    def remove(self) -> None:
        if not self.nft:
            return
        try:
            self._run(f"table inet {self.table} {{}}\ndelete table inet {self.table}\n")
        except (NetPolicyError, OSError, subprocess.SubprocessError) as exc:
            log.warning("could not remove nft table %s: %s", self.table, exc)

    def own_ports_sync(self, uids: set[int]) -> None:
        """Let each job uid reach the ports it listens on itself (and nobody else's)."""
        if not self.nft:
            return
        own = (frozenset(listening("tcp", uids)), frozenset(listening("udp", uids)))
        if own == self._own:
            return
        lines = []
        for name, pairs in (("own_tcp", own[0]), ("own_udp", own[1])):
            lines.append(f"flush set inet {self.table} {name}")
            if pairs:
                elements = ", ".join(f"{port} . {uid}" for port, uid in sorted(pairs))
                lines.append(f"add element inet {self.table} {name} {{ {elements} }}")
        try:
            self._run("\n".join(lines) + "\n")
            self._own = own
        except (NetPolicyError, OSError, subprocess.SubprocessError) as exc:
            log.warning("could not update the job port sets: %s", exc)


def listening(proto: str, uids: set[int], proc: Path = Path("/proc/net")) -> set[tuple[int, int]]:
    """(port, uid) of the sockets ``uids`` listen on (TCP LISTEN, or any bound UDP socket)."""
    found = set()
    for name in PROC_NET[proto]:
        try:
            lines = (proc / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 8:
                continue
            if proto == "tcp" and parts[3] != "0A":
                continue
            uid = int(parts[7])
            if uid in uids:
                found.add((int(parts[1].rsplit(":", 1)[1], 16), uid))
    return found
