"""The chaos suite's cuttable TCP proxy, against a local echo server (no Redis, no database)."""

from __future__ import annotations

import socket
import threading

import pytest

from chaos.proxy import CuttableProxy


@pytest.fixture
def echo_server():
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(
                target=lambda c=conn: [c.sendall(d) for d in iter(lambda: c.recv(1024), b"")], daemon=True
            ).start()

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1]
    server.close()


def roundtrip(port: int, data: bytes) -> bytes:
    """What comes back; b"" when the link is closed or reset on us."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        try:
            s.sendall(data)
            return s.recv(1024)
        except ConnectionResetError:
            return b""


def test_proxy_passes_cuts_and_restores(echo_server):
    proxy = CuttableProxy("127.0.0.1", echo_server)
    try:
        assert roundtrip(proxy.port, b"hello") == b"hello"
        held = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        held.sendall(b"a")
        assert held.recv(10) == b"a"
        proxy.cut()
        assert held.recv(10) == b""  # the open link is dropped
        held.close()
        assert roundtrip(proxy.port, b"x") == b""  # new links are refused while cut
        assert proxy.refused == 1
        proxy.restore()
        assert roundtrip(proxy.port, b"back") == b"back"
    finally:
        proxy.close()


def test_proxy_answers_http_500_when_asked(echo_server):
    proxy = CuttableProxy("127.0.0.1", echo_server)
    try:
        proxy.http_500()
        answer = roundtrip(proxy.port, b"GET /v1/customers HTTP/1.1\r\nHost: x\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 500 ")
        assert proxy.answered_500 == 1
        proxy.restore()
        assert roundtrip(proxy.port, b"ok") == b"ok"
    finally:
        proxy.close()
