"""Serializer pieces every REST endpoint's input shares."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from decimal import Decimal

from rest_framework import serializers


def _safe(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _kind(value) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if value is None:
        return "null"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _string_problems(field, value) -> list[str]:
    """What in ``value`` is not a string where ``field`` (or its child) takes one."""
    if isinstance(field, serializers.CharField):
        return [] if isinstance(value, str) or value is None else [f"must be a string, not {_kind(value)}"]
    child = getattr(field, "child", None)
    if not isinstance(child, serializers.CharField):
        return []
    if isinstance(field, serializers.ListField) and isinstance(value, list):
        return [
            f"item {i} must be a string, not {_kind(item)} ({_safe(repr(item))[:40]})"
            for i, item in enumerate(value)
            if not isinstance(item, str)
        ]
    if isinstance(field, serializers.DictField) and isinstance(value, dict):
        return [
            f"{_safe(str(key))[:60]} must be a string, not {_kind(item)} ({_safe(repr(item))[:40]})"
            for key, item in value.items()
            if not isinstance(item, str)
        ]
    return []


class StrictStrings:
    """Serializer mixin: a string field (or a list's or a mapping's string items) takes
    only JSON strings. DRF's CharField would turn ``1`` into ``"1"``: a client that
    sends ``command: [1, 2]`` or ``env: {"A": 1}`` gets a 400 naming the item instead."""

    def to_internal_value(self, data):
        if isinstance(data, Mapping):
            errors = {}
            for name, field in self.fields.items():
                if not field.read_only and name in data:
                    problems = _string_problems(field, data[name])
                    if problems:
                        errors[name] = problems
            if errors:
                raise serializers.ValidationError(errors)
        return super().to_internal_value(data)


class FieldsBuiltOnce:
    """Serializer mixin: the fields are built and bound once per thread and class, not for every instance.

    DRF deep-copies every declared field (and its validators) each time a serializer is made: ~0.7 ms of
    CPU in a submit of ~6. Only for input serializers whose fields keep nothing of a request and read no
    context: the shared fields' parent is the first instance this thread made.
    """

    _built = threading.local()

    @property
    def fields(self):
        found = self._built.__dict__.get(type(self))
        if found is None:
            found = self._built.__dict__[type(self)] = serializers.Serializer.fields.func(self)
        return found


EXACT = Decimal("0.0000000001")  # the platform's money: Decimal with 10 places (billing.rating.EXACT)


def money_exact(value) -> str:
    """An amount as the API shows money: exact, as stored (10 decimal places), as a string."""
    return format(Decimal(value or 0).quantize(EXACT), "f")
