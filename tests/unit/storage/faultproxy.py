"""A TCP proxy on 127.0.0.1 in front of a real S3 server that injects the faults networks make.

    proxy = FaultProxy(upstream_port).start()
    proxy.fail_next(2, status=503)     # the next two requests get "503 Slow Down"
    proxy.cut_after(1 << 20)           # the next response is cut (reset) after 1 MiB
    proxy.cut_first_past(1 << 20)      # the first response to pass 1 MiB is cut there

Everything else is passed through byte for byte, both ways.
"""

from __future__ import annotations

import socket
import struct
import threading

SLOW_DOWN = (
    b"HTTP/1.1 %d Slow Down\r\nContent-Type: application/xml\r\nContent-Length: %d\r\n"
    b"Connection: close\r\n\r\n%s"
)
BODY = b"<Error><Code>SlowDown</Code><Message>injected by the test</Message></Error>"


class FaultProxy:
    def __init__(self, upstream_port: int):
        self.upstream = ("127.0.0.1", upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._fail = 0
        self._status = 503
        self._cut: int | None = None
        self._cut_past: int | None = None
        self.injected = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def stop(self) -> None:
        self._listener.close()

    def fail_next(self, count: int, status: int = 503) -> None:
        with self._lock:
            self._fail, self._status = count, status

    def cut_after(self, nbytes: int) -> None:
        with self._lock:
            self._cut = nbytes

    def cut_first_past(self, nbytes: int) -> None:
        """Reset the first response (on any connection, new or kept alive) that passes
        `nbytes`, there: a fault in the one large download among small ones."""
        with self._lock:
            self._cut_past = nbytes

    def _claim_cut(self, sent: int) -> int | None:
        with self._lock:
            if self._cut_past is None or sent < self._cut_past:
                return None
            cut, self._cut_past = self._cut_past, None
            self.injected += 1
            return cut

    def _take_fault(self):
        with self._lock:
            if self._fail:
                self._fail -= 1
                self.injected += 1
                return "fail", self._status
            if self._cut is not None:
                cut, self._cut = self._cut, None
                self.injected += 1
                return "cut", cut
        return None, None

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        kind, arg = self._take_fault()
        if kind == "fail":
            client.recv(65536)  # the request's head; a 503 answers it and closes
            client.sendall(SLOW_DOWN % (arg, len(BODY), BODY))
            client.close()
            return
        upstream = socket.create_connection(self.upstream)
        threading.Thread(target=_pump, args=(client, upstream, None), daemon=True).start()
        _pump(upstream, client, arg if kind == "cut" else None, self._claim_cut)


def _pump(src: socket.socket, dst: socket.socket, cut: int | None, claim=None) -> None:
    """Copy src to dst; after `cut` bytes (or where claim(bytes so far) says), reset both
    connections (RST, not FIN)."""
    sent = 0
    try:
        while data := src.recv(65536):
            if cut is None and claim is not None:
                past = claim(sent + len(data))
                cut = None if past is None else max(past, sent)
            if cut is not None and sent + len(data) >= cut:
                dst.sendall(data[: cut - sent])
                for s in (dst, src):  # closed with linger 0: a reset, not a clean end
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    s.shutdown(socket.SHUT_RD)  # wakes the other direction's recv to close too
                break
            dst.sendall(data)
            sent += len(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.close()
            except OSError:
                pass
