"""Ports: a function a lower layer calls and a higher layer provides at start-up.

The domain apps import downwards only (``.importlinter``, checked by ``make test``). When a lower
app must ask a higher one something (the scheduler asks the admission layer whether a tenant may
submit; accounts asks the scheduler to stop a suspended tenant's jobs) it declares a ``Port`` and
the higher app plugs its function in from ``AppConfig.ready``. Calling a port nobody provided
raises ``ImproperlyConfigured``: it never answers "no limits".

Every declared port is checked at start-up by :func:`verify` (called from the last app's
``ready``) and by a Django system check, so a missing provider stops ``runserver``, ``migrate``,
``check``, the web processes and the worker before they serve anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured

_declared: dict[str, Port] = {}


class Port:
    def __init__(self, name: str, doc: str):
        if name in _declared:
            raise ImproperlyConfigured(f"port {name} is declared twice")
        self.name, self.__doc__ = name, doc
        self._provider: Callable[..., Any] | None = None
        _declared[name] = self

    def provide(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        self._provider = fn
        return fn

    @property
    def provided(self) -> bool:
        return self._provider is not None

    def __call__(self, *args, **kwargs):
        if self._provider is None:
            raise ImproperlyConfigured(f"nothing provides the port {self.name} ({self.__doc__}): is its app installed?")
        return self._provider(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<Port {self.name} {'provided' if self.provided else 'MISSING'}>"


def missing() -> list[str]:
    return sorted(name for name, port in _declared.items() if not port.provided)


def verify() -> None:
    """Raise at start-up when a declared port has no provider."""
    if names := missing():
        raise ImproperlyConfigured(f"no provider for the port(s) {', '.join(names)}: is the admission app installed?")


@checks.register()
def ports_check(app_configs=None, **kwargs):
    return [
        checks.Error(f"nothing provides the port {name}", hint="add the app that provides it to INSTALLED_APPS")
        for name in missing()
    ]
