"""Ports on this machine, and whether something answers on one: what starting and finding servers
and Ray heads asks."""

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now ("": on every interface)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def answers(host: str, port: int, timeout_s: float) -> bool:
    """Whether something accepts a connection at host:port within `timeout_s`."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False
