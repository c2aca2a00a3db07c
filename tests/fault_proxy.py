"""A small HTTP fault proxy for the tests: between a client (the loader) and a server (moto's S3, nginx).

It forwards TCP, one request per connection (each request's ``Connection`` header is rewritten to
``close``, so every request can be judged alone), and causes the faults a real network does:

- ``reset_every``: after that many response bytes (counted over all connections) the client's
  connection is reset (RST) mid-response;
- ``fail_every``: every k-th request is answered ``503 Slow Down`` instead of being forwarded;
- ``stall``: request numbers whose response is held back (no byte) for ``stall_s`` seconds;
- ``fail_matching``: requests whose target contains this text always get a 503.

It records what it saw (``requests``: (method, target, Range header); ``bytes_down``), so a test can
assert where a ranged read started. Threads only; ``close()`` stops it.
"""

from __future__ import annotations

import socket
import struct
import threading
from dataclasses import dataclass, field

_503 = (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: 72\r\nConnection: close\r\n\r\n"
        b"<Error><Code>SlowDown</Code><Message>Please slow down</Message></Error>\n")


@dataclass
class Faults:
    reset_every: int | None = None  # bytes of responses between two resets
    fail_every: int | None = None  # every k-th request gets a 503
    stall: set[int] = field(default_factory=set)  # these request numbers (1-based) stall
    stall_s: float = 0.0
    fail_matching: str | None = None


class FaultProxy:
    def __init__(self, upstream: str, faults: Faults | None = None):
        host, _, port = upstream.removeprefix("http://").rstrip("/").partition(":")
        self.upstream = (host, int(port or 80))
        self.faults = faults or Faults()
        self.requests: list[tuple[str, str, str | None]] = []
        self.bytes_down = 0
        self.resets = self.failed = self.stalled = 0
        self._since_reset = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._srv.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        self._srv.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            head = _read_head(client)
            if head is None:
                return
            lines = head.split(b"\r\n")
            method, target = lines[0].split(b" ")[:2]
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines[1:] if ln)}
            rng = headers.get(b"range")
            with self._lock:
                self.requests.append((method.decode(), target.decode(), rng.decode() if rng else None))
                n = len(self.requests)
            f = self.faults
            if (f.fail_matching and f.fail_matching in target.decode()) or (f.fail_every and n % f.fail_every == 0):
                with self._lock:
                    self.failed += 1
                client.sendall(_503)
                return
            lines = [ln for ln in lines if not ln.lower().startswith((b"connection:", b"keep-alive:"))]
            lines.insert(1, b"Connection: close")
            up = socket.create_connection(self.upstream)
            with up:
                up.sendall(b"\r\n".join(lines) + b"\r\n\r\n")
                body = int(headers.get(b"content-length", b"0"))
                while body > 0:  # a request body (uploads do not come through here; kept for completeness)
                    chunk = client.recv(min(body, 1 << 16))
                    if not chunk:
                        return
                    up.sendall(chunk)
                    body -= len(chunk)
                if n in f.stall:
                    with self._lock:
                        self.stalled += 1
                    self._stop.wait(f.stall_s)  # no byte for this long: the client's read timeout fires
                    return
                self._pipe_down(up, client)
        except OSError:
            pass
        finally:
            client.close()

    def _pipe_down(self, up: socket.socket, client: socket.socket) -> None:
        while True:
            data = up.recv(1 << 16)
            if not data:
                return
            reset = False
            with self._lock:
                every = self.faults.reset_every
                if every and self._since_reset + len(data) >= every:
                    data = data[:every - self._since_reset]
                    self._since_reset, reset = 0, True
                    self.resets += 1
                else:
                    self._since_reset += len(data)
                self.bytes_down += len(data)
            client.sendall(data)
            if reset:  # RST, not FIN: the client sees "connection reset by peer" mid-body
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return


def _read_head(sock: socket.socket) -> bytes | None:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(4096)
        if not chunk:
            return None
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    if rest:  # a body sent with the head: not expected for GET/HEAD, which is all the loader sends
        raise OSError("request body with the head")
    return head
