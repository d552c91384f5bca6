"""An HTTP proxy in front of moto's S3 server that loses writes and lies about them on HEAD.

The first PUT of each of the first ``lies`` batch objects (keys under ``/batches/``) is passed to the
store, answered as the store answered, and then deleted there: the object is lost. A HEAD of that key
is answered 200 with the size, ETag and ``x-amz-meta-sha256`` of the lost PUT, as a store whose
metadata and data paths disagree would. A GET answers what the store holds (404). A later PUT of the
same key passes through for good. A listing of multipart uploads gets each upload's true start time
(moto answers a fixed 2010 date). Everything else is forwarded unchanged (path-style addressing).

The same proxy corrupts in transit (issue 28): ``corrupt = "flip"`` flips one byte in the middle of
the next ``corrupt_left`` request bodies of PUTs (objects and parts), ``"truncate"`` cuts their last
1,000 bytes (sent with a matching Content-Length: a whole, shorter request). ``strip_md5`` drops
Content-MD5 from every request (moto then checks no checksum at all). ``reject_checksums`` answers
400 to any request carrying boto3's default checksums (``x-amz-checksum-*``,
``x-amz-sdk-checksum-algorithm``, an ``aws-chunked`` body), as some S3-compatible servers do.
``check_crc32`` does what AWS and MinIO do and moto 5.2.5 and rclone 1.75 do not: a PUT (object or part)
whose ``x-amz-checksum-crc32`` differs from the CRC32 of the body that reaches the server (after any
corruption above) is answered 400 BadDigest, not forwarded; moto behind it then stands for a server that
verifies CRC32 (moto stores the value it is sent, and answers a multipart object's composite of what it stored).
``fault_wrong_crc32 = (status, code)`` answers the next ``fault_left`` PUTs (objects and parts; with
``fault_match``, those whose path holds it) whose ``x-amz-checksum-crc32`` is not the body's, such as the
integrity probe's deliberately wrong one, with that error
instead of forwarding them (issue 37: a 503 SlowDown, a 500, a 403 where the server's own answer was due).
``bad_digests`` counts the PUTs the server behind answered 400 BadDigest (a server that checks the body).
"""

from __future__ import annotations

import base64
import http.client
import re
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from tests.waiting import scaled

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}


class LyingStoreProxy:
    def __init__(self, upstream: str, lies: int = 3):
        self.upstream = urlsplit(upstream)
        self.lies_left = lies
        self.lost: dict[str, dict[str, str]] = {}   # path -> the headers HEAD answers for the lost object
        self.lied_heads = 0
        self.initiated: dict[str, float] = {}       # multipart upload id -> when it was created (epoch s)
        self.corrupt: str | None = None             # None | "flip" | "truncate": what happens to PUT bodies
        self.corrupt_left = 0                       # PUT bodies still to corrupt
        self.corrupted = 0                          # PUT bodies corrupted so far
        self.corrupt_match = ""                     # only PUTs whose path holds this are corrupted
        self.strip_md5 = False
        self.reject_checksums = False
        self.check_crc32 = False
        self.rejected = 0                           # requests answered 400 for carrying default checksums
        self.fault_wrong_crc32: tuple[int, str] | None = None  # (status, code) for PUTs with a wrong CRC32
        self.fault_left = 0                         # such PUTs still to answer so
        self.fault_match = ""                       # only PUTs whose path holds this (".hsx-probe/": the probe's)
        self.faulted = 0                            # such PUTs answered so far
        self.bad_digests = 0                        # PUTs the server behind answered 400 BadDigest
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while size := int(self.rfile.readline().split(b";")[0], 16):
                        out += self.rfile.read(size)
                        self.rfile.readline()
                    self.rfile.readline()
                    return out
                return self.rfile.read(int(self.headers.get("Content-Length", 0)))

            def _forward(self, method: str, body: bytes | None) -> tuple[int, list[tuple[str, str]], bytes]:
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=scaled(30))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP and k.lower() != "expect"
                           and (body is not None or not k.lower().startswith(("content-", "x-amz-meta-")))
                           and not (proxy.strip_md5 and k.lower() == "content-md5")}
                if body is not None:
                    headers["Content-Length"] = str(len(body))
                conn.request(method, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                return resp.status, resp.getheaders(), data

            def _answer(self, status: int, headers, data: bytes, head: bool = False) -> None:
                self.send_response(status)
                for k, v in headers:
                    if k.lower() not in _HOP and k.lower() not in ("content-length", "date", "server"):
                        self.send_header(k, v)
                length = dict((k.lower(), v) for k, v in headers).get("content-length") if head else None
                self.send_header("Content-Length", length if length is not None else str(len(data)))
                self.end_headers()
                if not head:
                    self.wfile.write(data)

            def _carries_checksums(self) -> bool:
                names = {k.lower() for k in self.headers.keys()}
                return (any(n.startswith("x-amz-checksum-") or n == "x-amz-sdk-checksum-algorithm" for n in names)
                        or "aws-chunked" in self.headers.get("Content-Encoding", "")
                        or self.headers.get("x-amz-content-sha256", "").startswith("STREAMING-"))

            def _refused_checksums(self) -> bool:
                if not (proxy.reject_checksums and self._carries_checksums()):
                    return False
                self._body()
                with proxy._lock:
                    proxy.rejected += 1
                body = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InvalidArgument</Code><Message>'
                        b"x-amz-checksum-* and aws-chunked payloads are not supported</Message></Error>")
                self._answer(400, [("Content-Type", "application/xml")], body)
                return True

            def do_PUT(self):
                if self._refused_checksums():
                    return
                body = proxy._mangle(self.path, self._body())
                sent = self.headers.get("x-amz-checksum-crc32")
                wrong = sent is not None and sent != base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode()
                fault = proxy._fault() if wrong and proxy.fault_match in self.path else None
                if fault is not None:
                    status, code = fault
                    self._answer(status, [("Content-Type", "application/xml")], (
                        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>injected by '
                        "the test proxy</Message></Error>").encode())
                    return
                if proxy.check_crc32 and wrong:
                    self._answer(400, [("Content-Type", "application/xml")], (
                        b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>BadDigest</Code><Message>The CRC32 you '
                        b"specified did not match the calculated checksum.</Message></Error>"))
                    return
                status, headers, data = self._forward("PUT", body)
                if status == 400 and b"<Code>BadDigest</Code>" in data:
                    with proxy._lock:
                        proxy.bad_digests += 1
                path = self.path.split("?")[0]
                lie = False
                with proxy._lock:
                    if ("/batches/" in path and "?" not in self.path and status == 200 and proxy.lies_left > 0
                            and path not in proxy.lost):
                        proxy.lies_left -= 1
                        lie = True
                    elif path in proxy.lost:
                        proxy.lost.pop(path)
                if lie:
                    self._forward("DELETE", None)  # the store loses the object it just acknowledged
                    answered = dict(headers)
                    with proxy._lock:
                        proxy.lost[path] = {"Content-Length": str(len(body)), "ETag": answered.get("ETag", ""),
                                            "x-amz-meta-sha256": self.headers.get("x-amz-meta-sha256", "")}
                self._answer(status, headers, data)

            def do_HEAD(self):
                with proxy._lock:
                    lost = proxy.lost.get(self.path.split("?")[0])
                    if lost:
                        proxy.lied_heads += 1
                if lost:
                    self._answer(200, [*lost.items(), ("Content-Type", "binary/octet-stream")], b"", head=True)
                    return
                status, headers, data = self._forward("HEAD", None)
                self._answer(status, headers, data, head=True)

            def do_GET(self):
                if self._refused_checksums():
                    return
                status, headers, data = self._forward("GET", None)
                if "uploads" in self.path.partition("?")[2].split("&") and status == 200:
                    data = proxy._true_initiated(data)
                self._answer(status, headers, data)

            def do_DELETE(self):
                self._answer(*self._forward("DELETE", None))

            def do_POST(self):
                if self._refused_checksums():
                    return
                status, headers, data = self._forward("POST", self._body())
                created = re.search(rb"<UploadId>([^<]+)</UploadId>", data)
                if "uploads" in self.path.partition("?")[2].split("&") and status == 200 and created:
                    with proxy._lock:
                        proxy.initiated[created.group(1).decode()] = time.time()
                self._answer(status, headers, data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _fault(self) -> tuple[int, str] | None:
        """The error to answer a PUT with a wrong CRC32 with, while ``fault_left`` lasts."""
        with self._lock:
            if self.fault_wrong_crc32 is None or self.fault_left <= 0:
                return None
            self.fault_left -= 1
            self.faulted += 1
            return self.fault_wrong_crc32

    def _mangle(self, path: str, body: bytes) -> bytes:
        with self._lock:
            if not (self.corrupt and self.corrupt_left > 0 and len(body) > 2000 and self.corrupt_match in path):
                return body
            self.corrupt_left -= 1
            self.corrupted += 1
        if self.corrupt == "truncate":
            return body[:-1000]
        middle = len(body) // 2
        return body[:middle] + bytes([body[middle] ^ 0x01]) + body[middle + 1:]

    def _true_initiated(self, listing: bytes) -> bytes:
        """moto answers every upload's Initiated as 2010-11-10: put the time the proxy saw it created."""
        def fix(upload: re.Match) -> bytes:
            block = upload.group(0)
            upload_id = re.search(rb"<UploadId>([^<]+)</UploadId>", block)
            with self._lock:
                started = self.initiated.get(upload_id.group(1).decode()) if upload_id else None
            if started is None:
                return block
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(started)).encode()
            return re.sub(rb"<Initiated>[^<]*</Initiated>", b"<Initiated>" + stamp + b"</Initiated>", block)

        return re.sub(rb"<Upload>.*?</Upload>", fix, listing, flags=re.S)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
