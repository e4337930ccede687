"""A client that sends its request a byte at a time (slowloris), for the servers' tests."""

from __future__ import annotations

import socket


def trickled_until_closed(sock: socket.socket, head: bytes, trickle: bytes, pause_s: float) -> bool:
    """Send ``head``, then ``trickle`` a byte every ``pause_s`` or so (each well within the
    server's client timeout); True once the server closed the connection, False if the trickle
    ran out first."""
    sock.sendall(head)
    sock.settimeout(pause_s)
    for byte in trickle:
        try:
            sock.sendall(bytes([byte]))
            if sock.recv(65536) == b"":
                return True
        except TimeoutError:
            continue  # nothing to read: the server waits on us
        except OSError:  # reset, or a broken pipe: closed
            return True
    return False
