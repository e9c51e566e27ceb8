"""Outbound HTTP for webhooks that reaches only public addresses (unless the operator allows).

The host is resolved when the connection is made, every address it resolves to
is checked, the socket connects to an address that passed (so a DNS answer that
changes between a check and the connect, "DNS rebinding", cannot slip an
internal address in), and the peer address of the connected socket is checked
again before a byte is sent. Redirects are not followed and proxies from the
environment are not used: the address checked is the address connected to.
TLS still verifies the certificate against the URL's host name.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass

import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class BlockedAddress(Exception):
    """The URL's host is (or resolved to) an address webhooks may not reach."""


def address_problem(ip: str, allowed: Iterable[Network] = ()) -> str | None:
    """Why ``ip`` may not be reached (None: it may): loopback, link-local, private, ...
    unless it lies in one of the operator's ``allowed`` networks."""
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if any(addr in network for network in allowed):
        return None
    for test, what in (
        ("is_loopback", "loopback"),
        ("is_link_local", "link-local"),
        ("is_multicast", "multicast"),
        ("is_unspecified", "unspecified"),
        ("is_reserved", "reserved"),
        ("is_private", "private"),
    ):
        if getattr(addr, test):
            return f"{addr} is a {what} address"
    if not addr.is_global:
        return f"{addr} is not a public address"
    return None


def networks_parse(text: str) -> tuple[Network, ...]:
    """``GPUSHARE_WEBHOOK_ALLOWED_NETWORKS``: comma-separated CIDRs (``10.0.0.0/8,127.0.0.1/32``)."""
    return tuple(ipaddress.ip_network(part.strip(), strict=False) for part in text.split(",") if part.strip())


def resolve(host: str, port: int, allowed: Iterable[Network] = ()) -> list[tuple]:
    """The addresses of ``host`` that may be reached, as getaddrinfo gives them; BlockedAddress when none may."""
    allowed = tuple(allowed)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise BlockedAddress(f"cannot resolve {host}: {exc}") from exc
    good, problems = [], []
    for info in infos:
        problem = address_problem(info[4][0], allowed)
        (problems if problem else good).append(problem or info)
    if not good:
        raise BlockedAddress(f"{host}: {'; '.join(sorted(set(problems)))}")
    return good


def _guarded_connect(conn, allowed: tuple[Network, ...]) -> socket.socket:
    last: OSError | None = None
    for family, kind, proto, _, address in resolve(conn._dns_host, conn.port, allowed):
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(conn.timeout if isinstance(conn.timeout, int | float) else 10)
            sock.connect(address)
            peer = sock.getpeername()[0]
            problem = address_problem(peer, allowed)  # the address actually connected to
            if problem:
                sock.close()
                raise BlockedAddress(f"{conn._dns_host}: connected to {problem}")
            conn.connected_address = peer
            return sock
        except OSError as exc:
            sock.close()
            last = exc
    raise last or OSError(f"cannot connect to {conn._dns_host}")


class _GuardedHTTPConnection(HTTPConnection):
    allowed: tuple[Network, ...] = ()
    connected_address = ""

    def _new_conn(self):
        return _guarded_connect(self, self.allowed)


class _GuardedHTTPSConnection(HTTPSConnection):
    allowed: tuple[Network, ...] = ()
    connected_address = ""

    def _new_conn(self):
        return _guarded_connect(self, self.allowed)


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    address: str


def post(url: str, body: bytes, headers: dict[str, str], *, allowed: Iterable[Network] = (), timeout=(5, 10)) -> Answer:
    """POST ``body`` to ``url`` through the guarded connection. Raises BlockedAddress, or urllib3's errors."""
    allowed = tuple(allowed)
    parsed = urllib3.util.parse_url(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise BlockedAddress(f"{url}: only http and https URLs")
    https = parsed.scheme == "https"
    connection = type("Conn", (_GuardedHTTPSConnection if https else _GuardedHTTPConnection,), {"allowed": allowed})
    pool_class = HTTPSConnectionPool if https else HTTPConnectionPool
    pool = pool_class(
        parsed.host.strip("[]"),
        parsed.port or (443 if https else 80),
        timeout=urllib3.Timeout(connect=timeout[0], read=timeout[1]),
        retries=False,
        maxsize=1,
    )
    pool.ConnectionCls = connection
    try:
        response = pool.urlopen(
            "POST",
            parsed.request_uri,
            body=body,
            headers=headers,
            redirect=False,
            retries=False,
            preload_content=False,
            release_conn=False,
        )
        address = getattr(response.connection, "connected_address", "")  # before the read may release it
        excerpt = response.read(2048, decode_content=False)
        response.release_conn()
        return Answer(status=response.status, body=excerpt, address=address)
    finally:
        pool.close()
