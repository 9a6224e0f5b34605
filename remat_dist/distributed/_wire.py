"""The bytes and sockets under the side channel (``_channel``): where a rank's links
listen, how a message is framed and how a gather's parts are packed."""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

__all__ = [
    "HOST_ENV",
    "advertised_host",
    "nodelay",
    "pack_parts",
    "read_exact",
    "unpack_parts",
]

HOST_ENV = "REMAT_DIST_CHANNEL_HOST"
"""The address this rank's side-channel links listen on (default: the address of
the interface that reaches the c10d store's host; loopback for a local store)."""


def advertised_host(store: Any) -> str:
    """Where this rank's links listen: ``$REMAT_DIST_CHANNEL_HOST``, else the local
    address on the route to the store's host (loopback for a local store)."""
    env = os.environ.get(HOST_ENV)
    if env:
        return env
    base = store
    while hasattr(base, "underlying_store"):
        base = base.underlying_store
    host = getattr(base, "host", None)
    if not host:
        return "127.0.0.1"
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        return "127.0.0.1"
    if addr.startswith("127."):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((addr, int(getattr(base, "port", 1) or 1)))  # sends nothing
        return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        probe.close()


def nodelay(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def read_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed during the handshake")
        buf += chunk
    return bytes(buf)


_PART = struct.Struct("!iI")


def pack_parts(parts: dict[int, bytes]) -> bytes:
    return b"".join(_PART.pack(r, len(p)) + p for r, p in sorted(parts.items()))


def unpack_parts(data: bytes) -> dict[int, bytes]:
    out, i = {}, 0
    while i < len(data):
        r, n = _PART.unpack_from(data, i)
        i += _PART.size
        out[r] = data[i : i + n]
        i += n
    return out
