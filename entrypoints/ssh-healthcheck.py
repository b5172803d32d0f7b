"""Docker HEALTHCHECK for the SSH image: the server answers with an SSH banner."""

import os
import socket

port = int(os.environ.get("GPUFEED_SSH_PORT", "2222"))
with socket.create_connection(("127.0.0.1", port), timeout=3) as connection:
    banner = connection.recv(64)
if not banner.startswith(b"SSH-"):
    raise SystemExit(f"port {port} answered {banner!r}, not an SSH banner")
print(banner.decode().strip())
