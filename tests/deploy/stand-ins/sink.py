"""A stand-in for a telemetry service the deploy test can't pull (the OpenTelemetry collector,
Jaeger, Prometheus, Grafana): it answers every HTTP request on the given ports with 200 and
drops what it was sent. The services export OTLP/HTTP and drop what they can't send, so this
is enough for them; it shows nothing of their telemetry.

    python3 sink.py PORT [PORT ...]
"""

from __future__ import annotations

import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        while length > 0:  # read and drop the body
            chunk = self.rfile.read(min(length, 1 << 16))
            if not chunk:
                break
            length -= len(chunk)
        body = b"{}"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = _answer

    def log_message(self, format: str, *args: object) -> None:
        pass


def main(ports: list[str]) -> None:
    if not ports:
        raise SystemExit("usage: sink.py PORT [PORT ...]")
    # PID 1 of its container: SIGTERM has no default action there, so `down` would wait out
    # its stop timeout.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    servers = [ThreadingHTTPServer(("0.0.0.0", int(p)), Sink) for p in ports]
    for server in servers[1:]:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"sink: answering on {', '.join(ports)}", flush=True)
    servers[0].serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
