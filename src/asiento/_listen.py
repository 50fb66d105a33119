"""The listening socket of asiento's servers (``asiento gateway``, ``asiento serve``).

Bound before uvicorn starts, so the URL printed is connectable at once. Its
connections send each write at once (``TCP_NODELAY``, inherited by the accepted
sockets): a streamed answer is many small writes, and with Nagle's algorithm each
one after the first waits for the client's delayed ACK, 40 ms on Linux.
"""

from __future__ import annotations

import socket


def listening_socket(host: str, port: int, *, backlog: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (``port=0``: a free one)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    return sock
