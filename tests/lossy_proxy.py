"""A real TCP proxy in front of a strategy server that loses chosen answers: the request reaches the server
and is answered, and the proxy closes the client's connection instead of passing the answer on, as a server
that dies right after its commit would (the client sees the connection dropped). HTTP/1.1 with keep-alive,
bodies with a Content-Length (what uvicorn sends for JSON); enough for the client's requests."""

from __future__ import annotations

import socket
import threading


def _read_message(sock: socket.socket, buf: bytes) -> tuple[bytes, bytes] | None:
    """One HTTP message (head + Content-Length body) from ``sock`` after ``buf``; and the bytes after it."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buf += chunk
    head, rest = buf.split(b"\r\n\r\n", 1)
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        rest += chunk
    return head + b"\r\n\r\n" + rest[:length], rest[length:]


class LossyProxy:
    """Listens on 127.0.0.1 (``url``) and forwards to ``upstream`` (host, port); ``lose(marker, n)``: the next
    ``n`` requests whose request line contains ``marker`` are served by the server and their answers lost."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.rules: dict[bytes, int] = {}
        self.lost: list[str] = []  # the request lines whose answers were lost
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def lose(self, marker: str, n: int = 1) -> None:
        with self.lock:
            self.rules[marker.encode()] = n

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _take(self, request: bytes) -> bool:
        line = request.split(b"\r\n", 1)[0]
        with self.lock:
            for marker, left in self.rules.items():
                if left > 0 and marker in line:
                    self.rules[marker] = left - 1
                    self.lost.append(line.decode())
                    return True
        return False

    def _serve(self, client: socket.socket) -> None:
        with client, socket.create_connection(self.upstream) as server:
            buf, sbuf = b"", b""
            while True:
                got = _read_message(client, buf)
                if got is None:
                    return
                request, buf = got
                server.sendall(request)
                answer = _read_message(server, sbuf)
                if answer is None:
                    return
                response, sbuf = answer
                if self._take(request):
                    return  # the server answered; the client never hears it
                client.sendall(response)
