"""The agent's log lines: human by default, JSON with ``--log-format json`` (python-json-logger).

Every line carries the node; a line about a job carries its id as ``job``
(taken from the message's ``job %s`` argument, or ``extra={"job": ...}``),
so a log pipeline can follow one job across the platform and its node.
"""

from __future__ import annotations

import logging
import re

_JOB_ARG = re.compile(r"%[sd]")


class AgentContext(logging.Filter):
    def __init__(self, node: str):
        super().__init__()
        self.node = node

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("No hostname was supplied"):
            return False  # kombu's chatter about a URL without a host (filesystem://)
        record.node = getattr(record, "node", None) or self.node
        if getattr(record, "job", None) is None and isinstance(record.msg, str) and isinstance(record.args, tuple):
            at = record.msg.find("job %s")
            if at >= 0:
                position = len(_JOB_ARG.findall(record.msg[:at]))
                if position < len(record.args):
                    record.job = record.args[position]
        return True


class PlainFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        record.where = f" [node={record.node}]" if getattr(record, "node", None) else ""
        return super().format(record)


def logging_setup(*, level: str, fmt: str, node: str) -> None:
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        formatter: logging.Formatter = JsonFormatter(
            "%(levelname)s %(name)s %(message)s",
            rename_fields={"levelname": "level", "name": "logger"},
            timestamp="time",
        )
    else:
        formatter = PlainFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler = logging.StreamHandler()
    handler.setFormatter(formatter)
    handler.addFilter(AgentContext(node))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
