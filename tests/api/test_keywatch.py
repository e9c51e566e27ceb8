"""gpushare.keywatch against the real Redis: notices of changed keys, liveness by PING, a lost link."""

from __future__ import annotations

import os
import secrets
import time

import pytest
import redis
from django.conf import settings

from gpushare import keywatch


@pytest.fixture
def server():
    return redis.Redis.from_url(settings.REDIS_URL)


@pytest.fixture
def watched(server):
    """A watch on a prefix of this test's own, and the notices it got."""
    prefix = f"test:keywatch:{secrets.token_hex(4)}:"
    notices: list = []
    watch = keywatch.watch_for(server, prefix=prefix, on_change=notices.append)
    live_within(watch, 2.0)
    yield watch, prefix, notices
    watch.close()


def live_within(watch, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not watch.poll():
        assert time.monotonic() < deadline, "the watch did not become live"
        time.sleep(0.01)


def test_a_change_under_the_prefix_is_applied_by_the_next_poll(watched, server):
    watch, prefix, notices = watched
    seen = watch.seen
    server.set(f"{prefix}a", "1")
    server.set(f"other:{secrets.token_hex(4)}", "1")  # outside the prefix: no notice
    server.delete(f"{prefix}a")
    assert watch.poll()
    assert notices == [[f"{prefix}a".encode()], [f"{prefix}a".encode()]]
    assert watch.seen == seen + 2


def test_a_flushed_database_forgets_everything(watched, server):
    watch, _, notices = watched
    server.flushdb()
    watch.poll()
    assert None in notices


def test_a_silent_server_is_not_live_and_the_link_is_made_again(watched, server, monkeypatch):
    """No PONG within LIVE_FOR_S (a partition, a paused server): not live, everything forgotten; the watch
    dials again and is live once the server answers."""
    watch, _, notices = watched
    monkeypatch.setattr(keywatch, "PING_EVERY_S", 0.05)
    monkeypatch.setattr(keywatch, "LIVE_FOR_S", 0.3)
    monkeypatch.setattr(keywatch, "RETRY_S", 0.0)
    epoch = watch.epoch
    time.sleep(0.06)
    server.execute_command("CLIENT", "PAUSE", 700, "ALL")
    assert watch.poll()  # still live (its last PONG is recent); sends a PING the paused server does not answer
    time.sleep(0.4)
    assert not watch.poll()
    assert notices[-1] is None and watch.epoch > epoch
    time.sleep(0.4)
    live_within(watch, 3.0)


def test_an_answer_read_late_vouches_only_for_when_its_ping_was_sent(watched, monkeypatch):
    """After a quiet spell the PONG waiting in the socket is old news: the first request is not trusted;
    it sends a fresh PING, and the next one is."""
    watch, _, _ = watched
    monkeypatch.setattr(keywatch, "PING_EVERY_S", 0.05)
    monkeypatch.setattr(keywatch, "LIVE_FOR_S", 0.2)
    time.sleep(0.06)
    assert watch.poll()  # sends a PING; its PONG arrives and waits, unread
    time.sleep(0.3)
    assert not watch.poll()
    live_within(watch, 1.0)


def test_a_kept_watch_stays_live_through_a_quiet_spell(watched, monkeypatch):
    """Kept (``KeyWatch.keep``), the watch is polled by the process's keeper thread too: after a spell with
    no request, longer than LIVE_FOR_S, the next request's poll finds it live. Unkept, the same spell leaves
    it not live (the test above): a client calling every few seconds asked Redis at every call."""
    watch, _, _ = watched
    monkeypatch.setattr(keywatch, "PING_EVERY_S", 0.05)
    monkeypatch.setattr(keywatch, "LIVE_FOR_S", 0.2)
    monkeypatch.setattr(keywatch, "KEEP_EVERY_S", 0.02)
    watch.keep()
    time.sleep(1.0)  # the keeper may be in a sleep of the default length when the test starts
    assert watch.poll()


def test_a_kept_watch_applies_a_notice_with_no_request_polling(watched, server, monkeypatch):
    watch, prefix, notices = watched
    monkeypatch.setattr(keywatch, "KEEP_EVERY_S", 0.02)
    watch.keep()
    time.sleep(0.6)
    server.set(f"{prefix}k", "1")
    deadline = time.monotonic() + 2.0
    while [f"{prefix}k".encode()] not in notices:  # the test never polls: the keeper applies it
        assert time.monotonic() < deadline, notices
        time.sleep(0.01)


def test_a_forked_child_keeps_its_own_watch_live(watched, monkeypatch):
    """Threads do not survive a fork: a child's first poll starts its own keeper."""
    watch, _, _ = watched
    monkeypatch.setattr(keywatch, "PING_EVERY_S", 0.05)
    monkeypatch.setattr(keywatch, "LIVE_FOR_S", 0.2)
    monkeypatch.setattr(keywatch, "KEEP_EVERY_S", 0.02)
    watch.keep()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            watch.poll()  # dials the child's own link
            time.sleep(0.6)
            os.write(write, b"live" if watch.poll() else b"not live")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 20) == b"live"


def test_a_closed_watch_is_not_kept(watched):
    watch, _, _ = watched
    watch.keep()
    watch.close()
    assert not watch.kept


def test_a_closed_link_is_noticed_at_once(watched, server):
    watch, _, notices = watched
    epoch = watch.epoch
    for conn in server.client_list():
        if "t" in conn["flags"] and "BCAST" not in conn["flags"]:
            server.client_kill_filter(_id=conn["id"])
    time.sleep(0.05)
    assert not watch.poll()
    assert notices == [None] and watch.epoch > epoch


def test_an_unreachable_server_is_dialled_at_most_every_retry_period(monkeypatch):
    monkeypatch.setattr(keywatch, "RETRY_S", 60.0)
    dials = []
    real = keywatch.socket.create_connection
    monkeypatch.setattr(keywatch.socket, "create_connection", lambda *a, **kw: dials.append(a) or real(*a, **kw))
    watch = keywatch.KeyWatch(host="127.0.0.1", port=1, prefix="x:", on_change=lambda keys: None)
    assert not watch.poll()
    assert not watch.poll()
    assert len(dials) == 1


def test_a_forked_child_does_not_read_its_parents_link(watched):
    watch, _, _ = watched
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, b"live" if watch.poll() else b"not live")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 20) == b"not live"  # it dials its own link first
    assert watch.poll()  # the parent's is untouched


def test_a_unix_socket_server_gets_no_watch():
    assert keywatch.watch_for(redis.Redis(unix_socket_path="/tmp/none.sock"), prefix="x:", on_change=None) is None


def self_signed(tmp_path):
    """A certificate for 127.0.0.1 that is its own CA, and its key: (cert path, key path)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpushare test redis")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "redis.crt", tmp_path / "redis.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


@pytest.fixture
def tls_server(tmp_path):
    """A Redis of this test's own that speaks only TLS: (port, its certificate)."""
    import shutil
    import socket
    import subprocess

    cert, key = self_signed(tmp_path)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [shutil.which("redis-server") or "/usr/bin/redis-server", "--port", "0", "--tls-port", str(port)]
    argv += ["--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert)]
    argv += ["--tls-auth-clients", "no", "--save", "", "--appendonly", "no", "--dir", str(tmp_path)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the TLS Redis did not start"
                time.sleep(0.05)
        yield port, cert
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_tls_server_is_watched_over_tls_with_the_urls_checks(tls_server, tmp_path):
    port, cert = tls_server
    prefix = "test:keywatch:tls:"
    notices: list = []
    trusted = redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(cert))
    watch = keywatch.watch_for(trusted, prefix=prefix, on_change=notices.append)
    live_within(watch, 3.0)
    trusted.set(f"{prefix}a", "1")
    assert watch.poll()
    assert notices == [[f"{prefix}a".encode()]]
    watch.close()

    (tmp_path / "other").mkdir()
    other, _ = self_signed(tmp_path / "other")
    untrusting = redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(other))
    refused = keywatch.watch_for(untrusting, prefix=prefix, on_change=notices.append)
    assert not refused.poll()  # the server's certificate is not signed by the CA the URL names: no link
    assert refused._sock is None
