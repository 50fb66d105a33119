"""The servers' listening socket: bound at once, and its connections never wait on Nagle."""

from __future__ import annotations

import socket

from asiento._listen import listening_socket


def test_accepted_connections_send_each_write_at_once() -> None:
    """TCP_NODELAY on the listening socket reaches the sockets it accepts (Linux inherits
    it): without it a stream's second write waits for the client's delayed ACK."""
    server = listening_socket("127.0.0.1", 0, backlog=1)
    client = socket.create_connection(server.getsockname(), timeout=5)
    accepted, _ = server.accept()
    try:
        assert server.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        for s in (accepted, client, server):
            s.close()


def test_port_zero_gets_a_free_port_that_is_listening_before_any_server_runs() -> None:
    server = listening_socket("127.0.0.1", 0, backlog=1)
    try:
        port = server.getsockname()[1]
        assert port > 0
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        server.close()
