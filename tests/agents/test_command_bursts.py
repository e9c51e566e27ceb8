"""A burst of commands (a scheduling pass's wave of launches) does not hold back the reports of jobs that
end meanwhile: the agent reaps and flushes within the burst, so the platform places the next jobs while
the rest of the burst is still being launched (docs/benchmarks.md, session 24: the array drain)."""

from __future__ import annotations

import time

from agents.agent import main as agent_main
from agents.agent.config import AgentConfig
from agents.agent.gpus import SimBackend
from agents.agent.main import Agent


class _Burst:
    """A link with ``n`` commands waiting."""

    connected = True

    def __init__(self, n: int):
        self.left = n

    def receive(self, timeout: float):
        if not self.left:
            return None
        self.left -= 1
        return object()


def _agent(tmp_path) -> Agent:
    config = AgentConfig(node="burst", token="gpn_test", broker_url="filesystem://", var_dir=tmp_path)
    return Agent(config, SimBackend("sim:1xH100-80GB", "burst"), link=_Burst(0), spool=None)


def test_jobs_that_end_during_a_burst_are_reported_before_it_ends(tmp_path, monkeypatch):
    agent = _agent(tmp_path)
    agent.link = _Burst(40)
    handled: list[float] = []
    reaped: list[tuple[int, str]] = []
    monkeypatch.setattr(agent, "handle", lambda command: (time.sleep(0.005), handled.append(time.monotonic())))
    monkeypatch.setattr(agent, "reap", lambda: reaped.append((len(handled), "reap")))
    monkeypatch.setattr(agent, "flush", lambda: reaped.append((len(handled), "flush")))
    agent.commands_receive(timeout=0.0)
    assert len(handled) == 40
    during = [(n, what) for n, what in reaped if n < 40]
    assert during, "nothing was reaped until the whole burst was handled"
    assert [what for _, what in during[:2]] == ["reap", "flush"]  # the ended jobs' reports go out at once
    # At most every REAP_WITHIN_BURST_S (plus one command): never after each command.
    assert len(during) <= 2 * (40 * 0.005 / agent_main.REAP_WITHIN_BURST_S + 2)


def test_a_short_burst_is_not_interrupted(tmp_path, monkeypatch):
    agent = _agent(tmp_path)
    agent.link = _Burst(3)
    calls: list[str] = []
    monkeypatch.setattr(agent, "handle", lambda command: None)
    monkeypatch.setattr(agent, "reap", lambda: calls.append("reap"))
    agent.commands_receive(timeout=0.0)
    assert calls == []  # step() reaps once after the burst, as before
