"""A TCP proxy that can cut its link: the agent talks to Redis through it,
the Stripe gateway to localstripe.

``cut()`` drops every open connection and refuses new ones (accepted, then
closed at once) until ``restore()``; ``http_500()`` answers every new
connection with an HTTP 500. The shared Redis server is never touched.
"""

from __future__ import annotations

import socket
import threading


class CuttableProxy:
    def __init__(self, target_host: str, target_port: int, *, listen_host: str = "127.0.0.1"):
        self.target = (target_host, target_port)
        self.listen_host = listen_host  # another address of this host's (a veth's: tests/nodelink/test_other_hosts.py)
        self.listener = socket.create_server((listen_host, 0))
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.open: set[socket.socket] = set()
        self.is_cut = False
        self.answer_500 = False
        self.answered_500 = 0
        self.connections = 0
        self.refused = 0
        self.running = True
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while self.running:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                if self.is_cut:
                    self.refused += 1
                    client.close()
                    continue
                if self.answer_500:
                    self.answered_500 += 1
                    threading.Thread(target=self._fail_http, args=(client,), daemon=True).start()
                    continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self.lock:
                self.open |= {client, upstream}
                self.connections += 1
            threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _fail_http(client: socket.socket) -> None:
        """Read one HTTP request head and answer 500, as a broken upstream would."""
        try:
            client.settimeout(5)
            client.recv(65536)
            body = b'{"error": {"message": "chaos: upstream answered 500", "type": "api_error"}}'
            client.sendall(
                b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
        except OSError:
            pass
        finally:
            client.close()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                self._close(s)

    def _close(self, s: socket.socket) -> None:
        with self.lock:
            self.open.discard(s)
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()

    def cut(self) -> None:
        with self.lock:
            self.is_cut = True
            victims = list(self.open)
        for s in victims:
            self._close(s)

    def http_500(self) -> None:
        """Answer every new connection with an HTTP 500 (open ones are dropped)."""
        self.cut()
        with self.lock:
            self.is_cut = False
            self.answer_500 = True

    def restore(self) -> None:
        with self.lock:
            self.is_cut = False
            self.answer_500 = False

    def url(self, db: int) -> str:
        """A Redis URL through this proxy."""
        return f"redis://{self.listen_host}:{self.port}/{db}"

    def close(self) -> None:
        self.running = False
        self.cut()
        self.listener.close()
