"""A TCP proxy in front of the S3 endpoint that tests can take down or make throttle.

Modes: ``up`` (bytes pass through), ``down`` (listener closed, live connections
cut: connection refused / reset, like an endpoint outage), ``slowdown`` (every
request is answered ``503 SlowDown`` the way S3 throttles), ``forbidden`` (every
request is answered ``403 AccessDenied``, as S3 does under a denying bucket
policy), ``strip_metadata`` (bytes pass, but ``x-amz-meta-*`` headers are cut
from the answers: a store that drops user metadata).
"""

from __future__ import annotations

import re
import socket
import threading

SLOWDOWN_BODY = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                 b"<Message>Please reduce your request rate.</Message></Error>")
DENIED_BODY = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
               b"<Message>Access Denied by the bucket policy (faultproxy)</Message></Error>")
_META_HEADER = re.compile(rb"\r\nx-amz-meta-[^\r\n]*", re.IGNORECASE)
ANSWERS = {"slowdown": (b"503 Slow Down", SLOWDOWN_BODY), "forbidden": (b"403 Forbidden", DENIED_BODY)}


class FaultProxy:
    def __init__(self, upstream_port: int, port: int = 0):
        self.upstream = ("127.0.0.1", upstream_port)
        self.port = port
        self.mode = "down"
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_mode(self, mode: str) -> None:
        assert mode in ("up", "down", "slowdown", "forbidden", "strip_metadata")
        if mode == "down":
            self._close_all()
        elif self._listener is None:
            self._listen()
        self.mode = mode

    def _listen(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        self.port = s.getsockname()[1]
        s.listen(64)
        self._listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def _close_all(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, set()
        for c in ([listener] if listener else []) + list(conns):
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def _track(self, *socks) -> None:
        with self._lock:
            self._conns.update(socks)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            if self.mode in ANSWERS:
                threading.Thread(target=self._answer, args=(client, *ANSWERS[self.mode]), daemon=True).start()
                continue
            try:
                upstream = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            self._track(client, upstream)
            strip = self.mode == "strip_metadata"
            for a, b, cut in ((client, upstream, False), (upstream, client, strip)):
                threading.Thread(target=self._pump, args=(a, b, cut), daemon=True).start()

    def _answer(self, client: socket.socket, status: bytes, body: bytes) -> None:
        try:
            client.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = client.recv(65536)
                if not chunk:
                    return
                data += chunk
            client.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/xml\r\nConnection: close\r\n"
                           + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        except OSError:
            pass
        finally:
            client.close()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, strip_metadata: bool = False) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(_META_HEADER.sub(b"", chunk) if strip_metadata else chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        self._close_all()
