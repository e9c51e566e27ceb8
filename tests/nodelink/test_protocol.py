"""The protocol module and the agent's outbox, without processes: checks, signatures, resend and acknowledgement."""

from __future__ import annotations

import subprocess
import sys

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from agents.agent import protocol as p
from agents.agent.spool import Spool


def keys():
    private = Ed25519PrivateKey.generate()
    public = p.public_key_parse(p.public_key_text(private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)))
    return private, public


def test_the_agent_side_of_the_protocol_imports_no_django():
    """The agent (and the protocol it shares) loads neither Django's settings nor ORM nor any platform app."""
    platform = ("django.conf", "django.db", "gpushare", "billing", "scheduler", "agents.models", "agents.services")
    code = f"import sys, agents.agent.main; print([m for m in sys.modules if m.startswith({platform!r})])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_signed_command_verifies_once_for_its_node(tmp_path):
    private, public = keys()
    spool = Spool(tmp_path / "s.sqlite3")
    verifier = p.CommandVerifier("n1", [public], spool.nonce_seen)
    envelope = p.CommandSigner(private).sign("n1", p.STOP, {"job_id": 5, "attempt": 2, "reason": "x", "grace_s": 1})

    command = verifier.verify(p.STOP, envelope)

    assert (command.task, command.body["job_id"], command.body["attempt"]) == (p.STOP, 5, 2)
    with pytest.raises(p.CommandRefused, match="replayed"):
        verifier.verify(p.STOP, envelope)
    # the nonce survives a restart of the agent (same state file)
    again = p.CommandVerifier("n1", [public], Spool(tmp_path / "s.sqlite3").nonce_seen)
    with pytest.raises(p.CommandRefused, match="replayed"):
        again.verify(p.STOP, envelope)


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        (lambda e: {k: v for k, v in e.items() if k != "sig"}, "unsigned"),
        (lambda e: {**e, "sig": e["sig"][:-4] + "AAA="}, "bad signature"),
        (lambda e: {**e, "signed": e["signed"][:-4] + "AAA="}, "bad signature"),
        (lambda e: {**e, "kid": "0" * 16}, "does not trust"),
    ],
)
def test_a_tampered_command_is_refused(tamper, reason):
    private, public = keys()
    envelope = p.CommandSigner(private).sign("n1", p.LAUNCH, {"job_id": 1, "attempt": 1, "command": ["true"]})
    with pytest.raises(p.CommandRefused, match=reason):
        p.CommandVerifier("n1", [public], lambda *_: False).verify(p.LAUNCH, tamper(envelope))


def test_a_command_delivered_under_another_name_or_for_another_node_is_refused():
    private, public = keys()
    signer = p.CommandSigner(private)
    verifier = p.CommandVerifier("n1", [public], lambda *_: False)
    stop = signer.sign("n1", p.STOP, {"job_id": 1, "attempt": 1})
    with pytest.raises(p.CommandRefused, match="delivered as"):
        verifier.verify(p.LAUNCH, stop)
    with pytest.raises(p.CommandRefused, match="addressed to node"):
        verifier.verify(p.STOP, signer.sign("n2", p.STOP, {"job_id": 1, "attempt": 1}))
    with pytest.raises(p.CommandRefused, match="expired"):
        verifier.verify(p.REGISTER, signer.sign("n1", p.REGISTER, {}, now=p.now_ms() - 3_600_000))
    # a stop lives a day: it must still reach a node that was offline for an hour
    assert verifier.verify(p.STOP, signer.sign("n1", p.STOP, {"job_id": 1}, now=p.now_ms() - 3_600_000)).task == p.STOP


def test_during_a_rotation_both_keys_are_trusted():
    (old, old_public), (new, new_public) = keys(), keys()
    verifier = p.CommandVerifier("n1", [old_public, new_public], lambda *_: False)
    for key in (old, new):
        assert verifier.verify(p.REGISTER, p.CommandSigner(key).sign("n1", p.REGISTER, {})).task == p.REGISTER


def test_reports_are_checked_field_by_field():
    ok = p.report_parse(p.R_JOB_STARTED, {"token": "t", "seqs": [3], "job_id": 1, "attempt": 1, "at_ms": 5})
    assert ok.seqs == (3,) and ok.body == {"job_id": 1, "attempt": 1, "at_ms": 5}
    for bad, why in [
        ({"seqs": [], "job_id": 1, "at_ms": 5}, "no node credential"),
        ({"token": "t", "job_id": "1", "at_ms": 5}, "job_id must be an integer"),
        ({"token": "t", "job_id": 1, "at_ms": 5, "cost": 9}, "unknown field"),
        ({"token": "t", "v": 2, "job_id": 1, "at_ms": 5}, "version"),
    ]:
        with pytest.raises(p.ProtocolError, match=why):
            p.report_parse(p.R_JOB_STARTED, bad)
    with pytest.raises(p.ProtocolError, match="not a report"):
        p.report_parse("billing.close_month", {"token": "t"})


def test_the_outbox_keeps_a_report_until_acknowledged_and_resends_it(tmp_path):
    spool = Spool(tmp_path / "s.sqlite3")
    first = spool.put(p.R_USAGE, {"windows": [], "token": "gpn_secret", "node": "n1"})
    second = spool.put(p.R_LOGS, {"job_id": 1, "offset": 0, "data_b64": ""})
    assert "gpn_secret" not in (tmp_path / "s.sqlite3").read_bytes().decode(errors="replace")
    assert [r[0] for r in spool.due(resend_after_s=30)] == [first, second]
    spool.mark_sent([first, second], now_ms=1_000_000)
    assert spool.due(resend_after_s=30, now_ms=1_010_000) == []  # sent 10 s ago: not yet
    assert spool.remove([first]) == 1  # acknowledged
    assert [r[0] for r in spool.due(resend_after_s=30, now_ms=1_040_000)] == [second]  # re-sent after 30 s
    assert spool.pending() == 1


def test_an_old_outbox_loses_its_stored_tokens(tmp_path):
    import json
    import sqlite3

    db = sqlite3.connect(tmp_path / "s.sqlite3")
    db.execute("CREATE TABLE outbox (id INTEGER PRIMARY KEY AUTOINCREMENT, task TEXT NOT NULL, kwargs TEXT NOT NULL)")
    db.execute(
        "INSERT INTO outbox (task, kwargs) VALUES (?, ?)",
        (p.R_USAGE, json.dumps({"token": "gpn_x", "node": "n", "windows": []})),
    )
    db.commit()
    db.close()
    spool = Spool(tmp_path / "s.sqlite3")
    [(_, _, kwargs, sent)] = spool.due()
    assert kwargs == {"windows": []} and sent is None
