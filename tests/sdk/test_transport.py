"""The SDK's direct HTTP (gpushare_client/transport.py) against real sockets: kept-alive connections,
one write per request, a connection the server closed while idle, failures retried by the policy and
then raised as ``Unreachable``, answers lost on the way back; and urllib3's proxy path kept."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import urllib3

from gpushare_client import Client, Unreachable


class Server:
    """A plain TCP server answering each request per ``behaviour``: "ok" (a JSON answer, kept alive),
    "close" (answers, then closes the connection while idle), "drop" (reads the request, closes without
    a byte). Records each connection and the reads of each request."""

    def __init__(self, behaviour: str = "ok"):
        self.behaviour = behaviour
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.requests: list[tuple[int, bytes, int]] = []  # (connection, the request as read, reads it took)
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self):
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(sock, self.connections), daemon=True).start()

    def _serve(self, sock: socket.socket, number: int):
        with sock:
            while True:
                data, reads = b"", 0
                while b"\r\n\r\n" not in data or len(data) < self._expected(data):
                    chunk = sock.recv(65536)
                    if not chunk:
                        return
                    data, reads = data + chunk, reads + 1
                self.requests.append((number, data, reads))
                if self.behaviour == "drop":
                    return
                body = b'{"ok": true}'
                sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(body), body))  # fmt: skip
                if self.behaviour == "close":
                    time.sleep(0.1)
                    return

    @staticmethod
    def _expected(data: bytes) -> int:
        head, _, _ = data.partition(b"\r\n\r\n")
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                return len(head) + 4 + int(value)
        return len(head) + 4

    def close(self):
        self.listener.close()


@pytest.fixture
def no_proxy(monkeypatch):
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)


def test_calls_share_one_kept_alive_connection_and_a_post_goes_in_one_write(no_proxy):
    server = Server()
    try:
        client = Client(server.url, "t", retries=0)
        assert client.direct is not None
        assert client.get("") == {"ok": True}
        assert client.request("POST", "jobs/", json={"command": ["x" * 2000]})[1] == {"ok": True}
        assert client.get("jobs/", page_size=5) == {"ok": True}
    finally:
        server.close()
    assert server.connections == 1
    (_, get, _), (_, post, post_reads), (_, listed, _) = server.requests
    assert get.startswith(b"GET /api/v1/ HTTP/1.1\r\n") and b"Authorization: Bearer t\r\n" in get
    assert post.startswith(b"POST /api/v1/jobs/ HTTP/1.1\r\n") and post.endswith(b'"]}')
    assert post_reads == 1  # the head and the body arrived together
    assert listed.startswith(b"GET /api/v1/jobs/?page_size=5 HTTP/1.1\r\n")


def test_a_connection_the_server_closed_while_idle_is_replaced_even_without_retries(no_proxy):
    server = Server("close")
    try:
        client = Client(server.url, "t", retries=0)
        assert client.get("") == {"ok": True}
        time.sleep(0.3)  # the server has closed the kept-alive connection meanwhile
        assert client.get("") == {"ok": True}
    finally:
        server.close()
    assert server.connections == 2


def test_an_answer_lost_on_the_way_back_is_retried_then_unreachable(no_proxy):
    server = Server("drop")
    try:
        client = Client(server.url, "t", retries=2, backoff=0.01)
        with pytest.raises(Unreachable, match="cannot reach"):
            client.get("")
    finally:
        server.close()
    assert len(server.requests) == 3  # the first try and two retries, each on a new connection
    assert server.connections == 3


def test_a_refused_connection_is_retried_with_backoff_then_unreachable(no_proxy):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
    client = Client(f"http://127.0.0.1:{port}", "t", retries=2, backoff=0.2)
    started = time.monotonic()
    with pytest.raises(Unreachable):
        client.get("")
    assert time.monotonic() - started >= 0.4  # backoff: none before the first retry, 0.4 s before the second


def test_through_a_proxy_the_call_goes_through_urllib3s_proxy_manager(no_proxy, monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.example:3128")
    client = Client("http://gpushare.example", "t")
    assert isinstance(client.http, urllib3.ProxyManager) and client.direct is None
