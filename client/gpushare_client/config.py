"""Where the SDK and the CLI find the platform and its token.

In order: ``--url``/``--token`` flags, then ``GPUSHARE_URL``/``GPUSHARE_TOKEN``,
then ``$XDG_CONFIG_HOME/gpushare/config.toml`` (default ``~/.config/...``)::

    url = "https://gpushare.example.com"
    token = "gps_..."
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

__all__ = ["Config", "ConfigError", "config_load", "config_path"]


@dataclass(frozen=True)
class Config:
    url: str
    token: str


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "gpushare" / "config.toml"


def config_load(*, url: str | None = None, token: str | None = None) -> Config:
    path = config_path()
    from_file: dict = {}
    if path.is_file():
        try:
            from_file = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from exc
    url = url or os.environ.get("GPUSHARE_URL") or from_file.get("url")
    token = token or os.environ.get("GPUSHARE_TOKEN") or from_file.get("token")
    if not url:
        raise ConfigError(f"no platform address: set GPUSHARE_URL or 'url' in {path}")
    if not token:
        raise ConfigError(f"no API token: set GPUSHARE_TOKEN or 'token' in {path}")
    return Config(url=str(url).rstrip("/"), token=str(token))
