"""The node link's protocol, written once: what the platform and a node agent say to each other.

Pure Python (no Django import): the agent and the platform both import it.

Two directions, two trust rules:

- **Commands** (platform -> one node, on the node's own queue ``node.<name>``):
  ``agent.launch``, ``agent.stop``, ``agent.register``, ``agent.ack``. Each is
  an Ed25519-signed envelope (the ``cryptography`` package) naming the node, the
  job and attempt it is about, when it was issued, when it expires and a random
  nonce. An agent executes a command only if the signature verifies with one of
  the platform's public keys it trusts, the node is itself, it has not expired
  and its nonce was never seen (nonces are remembered until they expire).
  Anything else is refused, logged with the reason and reported to the platform
  (``agents.command_refused``).
- **Reports** (every node -> the platform, on the one report queue ``reports``):
  ``agents.register``, ``agents.heartbeat``, ``agents.job_started``,
  ``agents.job_exited``, ``agents.usage``, ``agents.logs``, ``agents.gpu_health``,
  ``agents.command_refused``. Each carries the node's credential (added when it
  is sent, never stored in the outbox) and the outbox sequence numbers it
  delivers; the platform derives the sender from the credential, never from a
  ``node`` field, and acknowledges the sequence numbers once the report is
  stored (``agent.ack``), so the agent re-sends what was never confirmed.

Both travel as Celery task messages (protocol 2) so a plain Celery worker runs
the reports; only the fields below are believed, each checked on receipt.
"""

from __future__ import annotations

import base64
import binascii
import json
import secrets
import time
from dataclasses import asdict, dataclass
from uuid import uuid4

from .brokerconf import REPORT_QUEUE

__all__ = ["REPORT_QUEUE", "VERSION"]  # and the names below

VERSION = 1

# --- message types -----------------------------------------------------------

LAUNCH, STOP, REGISTER, ACK = "agent.launch", "agent.stop", "agent.register", "agent.ack"
COMMANDS = (LAUNCH, STOP, REGISTER, ACK)

R_REGISTER = "agents.register"
R_HEARTBEAT = "agents.heartbeat"
R_JOB_STARTED = "agents.job_started"
R_JOB_EXITED = "agents.job_exited"
R_USAGE = "agents.usage"
R_LOGS = "agents.logs"
R_GPU_HEALTH = "agents.gpu_health"
R_COMMAND_REFUSED = "agents.command_refused"
R_JOB_EVENTS = "agents.job_events"  # consecutive job_started / job_exited reports sent as one message
JOB_EVENTS = (R_JOB_STARTED, R_JOB_EXITED)


class ProtocolError(ValueError):
    """A message that does not follow the protocol; ``str()`` is the reason, for the log."""


# --- field checks ------------------------------------------------------------


def _int(v, name, *, minimum=0):
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProtocolError(f"{name} must be an integer, got {type(v).__name__}")
    if minimum is not None and v < minimum:
        raise ProtocolError(f"{name} must be >= {minimum}")
    return v


def _opt_int(v, name):
    return None if v is None else _int(v, name, minimum=None)


def _str(limit):
    def check(v, name):
        if not isinstance(v, str):
            raise ProtocolError(f"{name} must be a string, got {type(v).__name__}")
        if len(v) > limit:
            raise ProtocolError(f"{name} is longer than {limit} characters")
        return v

    return check


def _bool(v, name):
    if not isinstance(v, bool):
        raise ProtocolError(f"{name} must be true or false")
    return v


def _dict(v, name):
    if not isinstance(v, dict):
        raise ProtocolError(f"{name} must be an object")
    return v


def _list(v, name):
    if not isinstance(v, list):
        raise ProtocolError(f"{name} must be a list")
    return v


def _str_list(v, name):
    return [_str(4096)(x, f"{name}[]") for x in _list(v, name)]


def _str_dict(v, name):
    return {_str(256)(k, f"{name} key"): _str(65536)(x, f"{name}[{k}]") for k, x in _dict(v, name).items()}


# A field: (check, required, default). The schemas below are the whole protocol.
def F(check, default=..., required=None):
    return (check, default is ... if required is None else required, None if default is ... else default)


# --- usage windows (declared once: the agent's meter builds them, ingest reads them) ---


@dataclass(frozen=True)
class UsageWindow:
    """One metering window of one job attempt on one node."""

    job_id: int
    attempt: int
    seq: int  # per job attempt, from 0
    start_ms: int
    end_ms: int
    sm_util_ms: int  # Σ over the job's GPUs of (SM utilisation fraction × ms)
    memory_avg_mb: int
    memory_peak_mb: int
    energy_mj: int

    def as_dict(self) -> dict:
        return asdict(self)


WINDOW_FIELDS = tuple(UsageWindow.__dataclass_fields__)
WINDOW_SCHEMA = {
    "job_id": F(_int),
    "attempt": F(_int, 1),
    "seq": F(_int),
    "start_ms": F(_int),
    "end_ms": F(_int),
    "sm_util_ms": F(_int, 0),
    "memory_avg_mb": F(_int, 0),
    "memory_peak_mb": F(_int, 0),
    "energy_mj": F(_int, 0),
}


def _events(v, name):
    """The shape of a batch of job events; each event's body is checked where it is handled
    (:func:`job_event_parse`), so one malformed event is refused alone, not with its batch."""
    events = [_dict(e, f"{name}[]") for e in _list(v, name)]
    if not events:
        raise ProtocolError(f"{name} must not be empty")
    return events


def job_event_parse(event: dict) -> tuple[str, dict]:
    """``(task, body)`` of one event of an ``agents.job_events`` batch, checked like the report it stands for."""
    task = event.get("task")
    if task not in JOB_EVENTS:
        raise ProtocolError(f"{R_JOB_EVENTS}: {str(task)[:100]!r} is not a job event")
    unknown = sorted(set(event) - {"task", "body"})
    if unknown:
        raise ProtocolError(f"{R_JOB_EVENTS}: unknown field(s) {', '.join(unknown)[:200]}")
    return task, validate(REPORT_SCHEMAS[task], event.get("body"), task)


def _windows(v, name):
    return [_dict(w, f"{name}[]") for w in _list(v, name)]  # each window is checked by ingest (and quarantined)


# --- command bodies (what the signed envelope's ``body`` holds) --------------

COMMAND_SCHEMAS: dict[str, dict] = {
    LAUNCH: {
        "job_id": F(_int),
        "attempt": F(_int),
        "command": F(_str_list),
        "env": F(_str_dict, {}),
        "gpu_uuids": F(_str_list, []),
        "share_milli": F(_int, 1000),
        "mode": F(_str(16), "dedicated"),
        "max_runtime_s": F(_int, 86400),
        "grace_s": F(_int, 30),
        "tenant": F(_str(100), ""),
        "image": F(_str(300), ""),
        "array": F(_dict, {}),
    },
    STOP: {
        "job_id": F(_int),
        "attempt": F(_opt_int, None),
        "reason": F(_str(300), "stopped"),
        "grace_s": F(_int, 30),
    },
    REGISTER: {},
    ACK: {"seqs": F(lambda v, n: [_int(x, f"{n}[]") for x in _list(v, n)])},
}

# --- report bodies -----------------------------------------------------------

REPORT_SCHEMAS: dict[str, dict] = {
    R_REGISTER: {"info": F(_dict)},
    R_HEARTBEAT: {"gpus": F(_list, []), "at_ms": F(_int, 0)},
    R_JOB_STARTED: {"job_id": F(_int), "attempt": F(_opt_int, None), "at_ms": F(_int)},
    R_JOB_EXITED: {
        "job_id": F(_int),
        "attempt": F(_opt_int, None),
        "exit_code": F(_opt_int, None),
        "at_ms": F(_int),
        "reason": F(_str(1000), ""),
        "lost": F(_bool, False),
        "windows": F(_windows, []),
    },
    R_USAGE: {"windows": F(_windows)},
    R_JOB_EVENTS: {"events": F(_events)},
    R_LOGS: {"job_id": F(_int), "offset": F(_int), "data_b64": F(_str(1 << 20))},
    R_GPU_HEALTH: {"uuid": F(_str(96)), "event": F(_dict), "jobs": F(_list, []), "at_ms": F(_int, 0)},
    R_COMMAND_REFUSED: {
        "task": F(_str(100), ""),
        "reason": F(_str(300)),
        "job_id": F(_opt_int, None),
        "nonce": F(_str(64), ""),
    },
}
REPORTS = tuple(REPORT_SCHEMAS)
# Envelope fields around a report's body (flat in the Celery kwargs, beside the body's fields).
REPORT_ENVELOPE = ("v", "token", "node", "seqs", "sent_ms")


def validate(schema: dict, data: dict, what: str) -> dict:
    """``data`` checked against ``schema``: the known fields, typed, defaults filled; unknown ones refused."""
    if not isinstance(data, dict):
        raise ProtocolError(f"{what}: the body must be an object")
    unknown = sorted(set(data) - set(schema))
    if unknown:
        raise ProtocolError(f"{what}: unknown field(s) {', '.join(unknown)[:200]}")
    out = {}
    for name, (check, required, default) in schema.items():
        if name not in data:
            if required:
                raise ProtocolError(f"{what}: missing field {name}")
            out[name] = default
            continue
        try:
            out[name] = check(data[name], name)
        except ProtocolError as exc:
            raise ProtocolError(f"{what}: {exc}") from None
    return out


@dataclass(frozen=True)
class Report:
    task: str
    token: str
    claimed_node: str  # what the message says; never believed, only compared
    seqs: tuple[int, ...]
    body: dict


def report_parse(task: str, kwargs: dict) -> Report:
    """A report's Celery kwargs, checked: raises ProtocolError with the reason."""
    if task not in REPORT_SCHEMAS:
        raise ProtocolError(f"{task!r} is not a report")
    if not isinstance(kwargs, dict):
        raise ProtocolError(f"{task}: kwargs must be an object")
    version = kwargs.get("v", VERSION)
    if version != VERSION:
        raise ProtocolError(f"{task}: protocol version {version!r} is not {VERSION}")
    token = kwargs.get("token")
    if not isinstance(token, str) or not token:
        raise ProtocolError(f"{task}: no node credential")
    seqs = kwargs.get("seqs", [])
    if not isinstance(seqs, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in seqs):
        raise ProtocolError(f"{task}: seqs must be a list of integers")
    node = kwargs.get("node", "")
    body = {k: v for k, v in kwargs.items() if k not in REPORT_ENVELOPE}
    return Report(
        task=task,
        token=token,
        claimed_node=node if isinstance(node, str) else "",
        seqs=tuple(seqs),
        body=validate(REPORT_SCHEMAS[task], body, task),
    )


def report_kwargs(*, token: str, seqs: list[int], body: dict, node: str = "") -> dict:
    """A report's Celery kwargs: the body's fields and the envelope's, flat."""
    clash = set(body) & set(REPORT_ENVELOPE)
    if clash:
        raise ProtocolError(f"report body uses reserved field(s) {sorted(clash)}")
    return {"v": VERSION, "token": token, "node": node, "seqs": list(seqs), "sent_ms": now_ms(), **body}


# --- Celery's wire format (protocol 2) ----------------------------------------


def task_message(task: str, kwargs: dict) -> tuple[str, list, dict]:
    """``(task_id, body, headers)`` of a Celery task message, as ``send_task`` would build it."""
    task_id = str(uuid4())
    body = [[], kwargs, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]
    headers = {
        "lang": "py",
        "task": task,
        "id": task_id,
        "root_id": task_id,
        "parent_id": None,
        "group": None,
        "retries": 0,
        "eta": None,
        "expires": None,
        "ignore_result": True,
        "argsrepr": "()",
        "kwargsrepr": "{...}",  # never the body: it carries tenants' environment and the node credential
    }
    return task_id, body, headers


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# --- signed commands ------------------------------------------------------------

KEY_PREFIX = "ed25519:"


def public_key_text(raw: bytes) -> str:
    """A public key as operators copy it: ``ed25519:<base64 of the 32 raw bytes>``."""
    return KEY_PREFIX + base64.b64encode(raw).decode()


def public_key_parse(text: str):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    text = text.strip()
    if not text.startswith(KEY_PREFIX):
        raise ValueError(f"a node-link public key starts with {KEY_PREFIX!r}")
    try:
        raw = base64.b64decode(text[len(KEY_PREFIX) :], validate=True)
        return Ed25519PublicKey.from_public_bytes(raw)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not an Ed25519 public key: {exc}") from None


def key_id(public_raw: bytes) -> str:
    import hashlib

    return hashlib.sha256(public_raw).hexdigest()[:16]


class CommandSigner:
    """The platform's side: signs each command with its current Ed25519 private key."""

    # A stop must still reach a node that was offline for a while (the job keeps running and billing
    # until it does); a launch or an acknowledgement that expired is sent again by the platform anyway.
    LONG_LIVED = {STOP: 24 * 3600 * 1000}

    def __init__(self, private_key, *, ttl_s: int = 600):
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        self.key = private_key
        self.kid = key_id(private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))
        self.ttl_ms = int(ttl_s * 1000)

    def sign(self, node: str, task: str, body: dict, *, now: int | None = None) -> dict:
        if task not in COMMAND_SCHEMAS:
            raise ProtocolError(f"{task!r} is not a command")
        body = validate(COMMAND_SCHEMAS[task], body, task)  # the platform never sends what an agent would refuse
        issued = now_ms() if now is None else now
        claims = {
            "v": VERSION,
            "type": task,
            "node": node,
            "job_id": body.get("job_id"),
            "attempt": body.get("attempt"),
            "issued_ms": issued,
            "expires_ms": issued + max(self.ttl_ms, self.LONG_LIVED.get(task, 0)),
            "nonce": secrets.token_hex(16),
            "body": body,
        }
        signed = json.dumps(claims, separators=(",", ":"), sort_keys=True).encode()
        return {
            "v": VERSION,
            "kid": self.kid,
            "signed": base64.b64encode(signed).decode(),
            "sig": base64.b64encode(self.key.sign(signed)).decode(),
        }


@dataclass(frozen=True)
class VerifiedCommand:
    task: str
    body: dict
    nonce: str
    expires_ms: int
    job_id: int | None


class CommandRefused(Exception):
    def __init__(self, reason: str, *, task: str = "", job_id: int | None = None, nonce: str = ""):
        super().__init__(reason)
        self.reason, self.task, self.job_id, self.nonce = reason, task, job_id, nonce


class CommandVerifier:
    """The agent's side: only commands the platform signed, for this node, unexpired, never seen before.

    ``public_keys``: every key the agent trusts (during a rotation, the old and
    the new one). ``seen(nonce, expires_ms)`` records a nonce and says whether it
    was already recorded (the agent's spool keeps them until they expire, so a
    replay is refused across restarts too). ``skew_ms``: how far the platform's
    clock may run ahead of the node's.
    """

    def __init__(self, node: str, public_keys: list, seen, *, skew_ms: int = 30_000):
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        if not public_keys:
            raise ValueError("no node-link public key to verify commands with")
        self.node = node
        self.keys = {key_id(k.public_bytes(Encoding.Raw, PublicFormat.Raw)): k for k in public_keys}
        self.seen = seen
        self.skew_ms = skew_ms

    def verify(self, header_task: str, kwargs, *, now: int | None = None) -> VerifiedCommand:
        from cryptography.exceptions import InvalidSignature

        if not isinstance(kwargs, dict) or "sig" not in kwargs or "signed" not in kwargs:
            raise CommandRefused("unsigned command", task=header_task)
        kid = kwargs.get("kid")
        key = self.keys.get(kid) if isinstance(kid, str) else None
        if key is None:
            raise CommandRefused(f"signed with a key this agent does not trust ({str(kid)[:20]!r})", task=header_task)
        try:
            signed = base64.b64decode(kwargs["signed"], validate=True)
            key.verify(base64.b64decode(kwargs["sig"], validate=True), signed)
        except (InvalidSignature, binascii.Error, TypeError, ValueError):
            raise CommandRefused("bad signature", task=header_task) from None
        try:
            claims = json.loads(signed)
        except ValueError:
            raise CommandRefused("signed payload is not JSON", task=header_task) from None
        task, nonce = claims.get("type", ""), str(claims.get("nonce", ""))[:64]
        job_id = claims.get("job_id") if isinstance(claims.get("job_id"), int) else None
        refuse = lambda reason: CommandRefused(reason, task=task, job_id=job_id, nonce=nonce)  # noqa: E731
        if claims.get("v") != VERSION:
            raise refuse(f"protocol version {claims.get('v')!r} is not {VERSION}")
        if task != header_task:
            raise refuse(f"signed as {task!r} but delivered as {header_task!r}")
        if claims.get("node") != self.node:
            raise refuse(f"addressed to node {str(claims.get('node'))[:100]!r}, not this one")
        now = now_ms() if now is None else now
        issued, expires = claims.get("issued_ms"), claims.get("expires_ms")
        if not isinstance(issued, int) or not isinstance(expires, int) or not nonce:
            raise refuse("no issue time, expiry or nonce")
        if expires < now:
            raise refuse(f"expired {now - expires} ms ago")
        if issued > now + self.skew_ms:
            raise refuse(f"issued {issued - now} ms in the future")
        try:
            body = validate(COMMAND_SCHEMAS[task], claims.get("body"), task)
        except (KeyError, ProtocolError) as exc:
            raise refuse(f"malformed: {exc}") from None
        if body.get("job_id") != claims.get("job_id") or body.get("attempt") != claims.get("attempt"):
            raise refuse("the body's job or attempt differs from the signed claims")
        if self.seen(nonce, expires):
            raise refuse("replayed (nonce already used)")
        return VerifiedCommand(task=task, body=body, nonce=nonce, expires_ms=expires, job_id=job_id)


def public_keys_load(text: str) -> list:
    """Public keys from a file's or variable's text: one ``ed25519:...`` per line or comma; ``#`` comments."""
    keys = []
    for line in text.replace(",", "\n").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            keys.append(public_key_parse(line))
    return keys
