"""The platform's command-signing keys (Ed25519, the ``cryptography`` package).

Files in ``GPUSHARE["NODELINK_KEY_DIR"]`` (0700, each key 0600):

- ``signing.key``: the current private key (PEM, PKCS#8); every command is signed with it;
- ``next.key``: a staged key during a rotation (agents are given its public key first);
- ``trusted.pub``: the public keys agents should trust, one ``ed25519:...`` per line
  (the current key, plus the staged or the retired one during a rotation): what
  ``manage.py nodelink_keygen --public`` prints, for the agents'
  ``GPUSHARE_NODELINK_PUBLIC_KEYS`` / ``--platform-keys`` file.

``manage.py nodelink_keygen`` creates, stages and promotes them (operator guide).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
    load_pem_private_key,
)
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from .agent.protocol import CommandSigner, public_key_text

SIGNING, NEXT, TRUSTED = "signing.key", "next.key", "trusted.pub"


def key_dir() -> Path:
    return Path(settings.GPUSHARE["NODELINK_KEY_DIR"])


def _write_private(path: Path, key: Ed25519PrivateKey) -> None:
    """Write ``key`` to ``path`` atomically, 0600; never replaces an existing file (O_EXCL + link)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    pem = key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, pem)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # fails if another process created it first: theirs wins
    finally:
        tmp.unlink()


def _read_private(path: Path) -> Ed25519PrivateKey:
    key = load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ImproperlyConfigured(f"{path} is not an Ed25519 private key")
    return key


def public_text(key: Ed25519PrivateKey) -> str:
    return public_key_text(key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))


def key_create(name: str = SIGNING, *, folder: Path | None = None) -> Ed25519PrivateKey:
    """The key ``name`` in ``folder`` (default: the configured key directory), created if missing."""
    path = (folder or key_dir()) / name
    if not path.exists():
        try:
            _write_private(path, Ed25519PrivateKey.generate())
        except FileExistsError:
            pass
    return _read_private(path)


def signing_key() -> Ed25519PrivateKey:
    path = key_dir() / SIGNING
    if not path.exists():
        if not settings.GPUSHARE["NODELINK_AUTO_KEY"]:
            raise ImproperlyConfigured(
                f"no node-link signing key at {path}: run `manage.py nodelink_keygen` and give the agents its "
                "public key (docs/operator-guide.md)"
            )
        key_create(SIGNING)
        trusted_write()
    return _read_private(path)


def trusted_keys() -> list[str]:
    """The public keys agents should trust now (``trusted.pub``, else the current key's)."""
    path = key_dir() / TRUSTED
    if path.exists():
        return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return [public_text(signing_key())]


def trusted_write(extra: list[str] = ()) -> list[str]:
    keys = [public_text(_read_private(key_dir() / SIGNING))]
    if (key_dir() / NEXT).exists():
        keys.append(public_text(_read_private(key_dir() / NEXT)))
    keys += [k for k in extra if k not in keys]
    path = key_dir() / TRUSTED
    tmp = path.with_name(f".{TRUSTED}.{os.getpid()}")
    tmp.write_text(
        "# node-link public keys an agent trusts (manage.py nodelink_keygen --public)\n" + "\n".join(keys) + "\n"
    )
    tmp.replace(path)
    _signer.cache_clear()
    return keys


def signer() -> CommandSigner:
    """The signer of the current key; a promoted key is picked up at the next command (the file's mtime)."""
    path = key_dir() / SIGNING
    try:
        stamp = path.stat().st_mtime_ns
    except FileNotFoundError:
        stamp = 0
    return _signer(str(path), stamp)


@functools.lru_cache(maxsize=2)
def _signer(path: str, stamp: int) -> CommandSigner:
    return CommandSigner(signing_key(), ttl_s=settings.GPUSHARE["NODELINK_COMMAND_TTL_S"])
