"""The address other hosts (the endpoint gateway) use to reach this node's replicas.

Pure Python, no Django: the agent checks its ``--advertise-address`` with
``address_valid`` and the platform checks what an agent reports with the same
function, so both sides agree on what a usable address is.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from urllib.parse import urlsplit

LOOPBACK = "127.0.0.1"
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def address_valid(value: str) -> bool:
    """True for an IP address or an RFC 1123 host name: something the gateway can put in a URL.

    A name whose last label is all digits ("10.0.0.300") is a mistyped IP
    address, not a host name.
    """
    if not isinstance(value, str) or not value or len(value) > 253:
        return False
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        pass
    labels = value.removesuffix(".").split(".")
    return all(_LABEL.fullmatch(label) for label in labels) and not labels[-1].isdigit()


def broker_host(broker_url: str) -> tuple[str, int] | None:
    """The broker's (host, port), or None when the URL names no host (``filesystem://``) or cannot be read.

    Only the first of several ``;``-separated URLs (failover, sentinel) counts.
    """
    try:
        parts = urlsplit(broker_url.split(";")[0])
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    return (host, port or 9) if host else None


def address_detect(broker_url: str) -> str:
    """This host's primary outbound IPv4 address: the source address of its route to the broker.

    The hosts that run the gateway sit next to the broker, so the interface
    the agent uses to reach the broker is the best guess at one they can
    reach back. Connecting a UDP socket only picks the route; no packet is
    sent. A broker on this host (or none, or no route) gives 127.0.0.1, which
    is right for a single-host setup and what the platform assumed before
    agents reported an address.
    """
    target = broker_host(broker_url)
    if target is None:
        return LOOPBACK
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(target)
            address = probe.getsockname()[0]
    except OSError:  # unresolvable name, no route, an IPv6-only broker
        return LOOPBACK
    return address if address_valid(address) and address != "0.0.0.0" else LOOPBACK
