"""The container image-reference grammar (distribution/reference, as the docker
CLI parses it), checked by the API and again by the agent, so that an
``image`` can never be read as a docker option (``--privileged``, ``-v /:/h``).

Pure: no Django, no docker. ``image_check(ref, allowed_registries)`` returns
the reason an image is refused, or "".
"""

from __future__ import annotations

import re

_ALNUM = r"[a-z0-9]+"
_SEPARATOR = r"(?:[._]|__|-+)"
_PATH_COMPONENT = rf"{_ALNUM}(?:{_SEPARATOR}{_ALNUM})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[0-9a-fA-F:.]+\])(?::[0-9]+)?"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
REFERENCE = re.compile(
    rf"^(?:(?P<domain>{_DOMAIN})/)?(?P<path>{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*)"
    rf"(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?\Z"
)
MAX_LENGTH = 255 + 128 + 100
DEFAULT_REGISTRY = "docker.io"


def image_registry(ref: str) -> str:
    """The registry an image comes from (``docker.io`` when the reference names none)."""
    first, sep, _rest = ref.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost" or first != first.lower()):
        return first.lower()
    return DEFAULT_REGISTRY


def image_check(ref: str, allowed_registries: tuple[str, ...] | list[str] = ()) -> str:
    """Why ``ref`` is not an acceptable image reference, or "" when it is."""
    if not ref:
        return ""
    if len(ref) > MAX_LENGTH:
        return f"an image reference is at most {MAX_LENGTH} characters"
    if ref.startswith("-"):
        return "an image reference cannot start with '-' (it would be read as a docker option)"
    match = REFERENCE.match(ref)
    if match is None:
        return (
            f"{ref!r} is not an image reference ([registry/]name[:tag][@digest], lower-case name, "
            "e.g. python:3.12-slim or ghcr.io/org/model@sha256:...)"
        )
    if match.group("domain") is None and "/" not in match.group("path") and len(match.group("path")) > 255:
        return "an image name is at most 255 characters"
    allowed = [r.strip().lower() for r in allowed_registries if r.strip()]
    if allowed and image_registry(ref) not in allowed:
        return f"images from {image_registry(ref)} are not allowed here (allowed registries: {', '.join(allowed)})"
    return ""
