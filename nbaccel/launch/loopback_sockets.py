"""Who holds a loopback TCP socket: its remote port, owner uid, inode and state, asked of the kernel by port.

The store guard (:mod:`nbaccel.launch.store_guard`) asks this once per connecting rank, so it must
be quick: the kernel's ``sock_diag`` netlink interface (what ``ss`` uses) answers in about 0.02 ms;
``/proc/net/tcp`` (10-25 ms a read here) is the fallback where netlink is refused. A v4-mapped
IPv6 socket (torch's ``TCPStore`` client uses ``::ffff:127.0.0.1``) counts as loopback.
"""

from __future__ import annotations

import socket
import struct
from pathlib import Path

__all__ = ["SocketRow", "loopback_sockets"]

SocketRow = tuple[int, int, int, int]
"""``(remote port, uid, inode, state)``; state as the kernel numbers it (1 established, 10 listening)."""

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_ENOENT = 2
_ALL_STATES = 0xFFFFFFFF
_NO_COOKIE = struct.pack("=II", 0xFFFFFFFF, 0xFFFFFFFF)
_LOOPBACK4 = socket.inet_aton("127.0.0.1")
_LOOPBACK_ADDRESSES = {_LOOPBACK4 + bytes(12), socket.inet_pton(socket.AF_INET6, "::ffff:127.0.0.1")}
# inet_diag_msg after the 16-byte netlink header: family, state, timer, retrans (4 bytes); the socket
# id: ports (4), source and destination addresses (16 each), interface (4), cookie (8); then
# expires, rqueue, wqueue, uid, inode (4 each).
_MSG = struct.Struct("=BBxx2s2s16s16s4x8x12xII")


def loopback_sockets(local_port: int, remote_port: int | None = None) -> list[SocketRow] | None:
    """The loopback TCP sockets bound to ``local_port`` (and connected to ``remote_port``).

    Listening sockets are not listed (their remote end is no loopback address).

    Returns:
        One row per socket, or ``None`` when the kernel tells neither by netlink nor in ``/proc``.

    Example:
        >>> server = socket.create_server(("127.0.0.1", 0))
        >>> client = socket.create_connection(server.getsockname())
        >>> port = server.getsockname()[1]
        >>> [(remote == port, state) for remote, _, _, state in loopback_sockets(client.getsockname()[1], port)]
        [(True, 1)]
        >>> client.close(); server.close()
    """
    try:
        return _by_netlink(local_port, remote_port)
    except OSError:
        return _by_proc(local_port, remote_port)


def _by_netlink(local_port: int, remote_port: int | None) -> list[SocketRow]:
    found: list[SocketRow] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as link:
        link.settimeout(5)  # the kernel answers at once; a silent one is a kernel to read /proc of instead
        if remote_port is not None:  # one connection: a lookup in the kernel's hash, by its ports
            found += _ask(link, socket.AF_INET, local_port, remote_port)
        else:  # every socket on the port: each family's table (an IPv6 socket is listed in its own)
            for family in (socket.AF_INET, socket.AF_INET6):
                found += _ask(link, family, local_port, None)
    return found


def _ask(link: socket.socket, family: int, local_port: int, remote_port: int | None) -> list[SocketRow]:
    """One sock_diag request; its answer filtered to loopback sockets on these ports (as /proc's search is)."""
    dump = remote_port is None
    ports = struct.pack("!HH", 0, 0) if dump else struct.pack("!HH", local_port, remote_port)
    addresses = bytes(32) if dump else 2 * (_LOOPBACK4 + bytes(12))
    request = (struct.pack("=BBBxI", family, socket.IPPROTO_TCP, 0, _ALL_STATES) + ports + addresses
               + struct.pack("=I", 0) + _NO_COOKIE)
    flags = _NLM_F_REQUEST | (_NLM_F_DUMP if dump else 0)
    link.send(struct.pack("=IHHII", 16 + len(request), _SOCK_DIAG_BY_FAMILY, flags, 1, 0) + request)
    rows: list[SocketRow] = []
    while True:
        data = link.recv(1 << 16)
        at = 0
        while at + 16 <= len(data):
            length, kind = struct.unpack_from("=IH", data, at)
            if kind == _NLMSG_DONE:
                return rows
            if kind == _NLMSG_ERROR:
                error = -struct.unpack_from("=i", data, at + 16)[0]
                if error in (0, _ENOENT):  # 0 ends a lookup's answer; ENOENT: no such connection
                    return rows
                raise OSError(error, "sock_diag refused the request")
            _, state, sport, dport, source, destination, uid, inode = _MSG.unpack_from(data, at + 16)
            local, remote = struct.unpack("!H", sport)[0], struct.unpack("!H", dport)[0]
            if (local == local_port and (remote_port is None or remote == remote_port)
                    and source in _LOOPBACK_ADDRESSES and destination in _LOOPBACK_ADDRESSES):
                rows.append((remote, uid, inode, state))
            at += (length + 3) & ~3
        if not dump:
            return rows


# 127.0.0.1 as /proc/net/tcp writes it, and as /proc/net/tcp6 writes it for an IPv6 socket talking IPv4.
_LOOPBACK_HEX = (b"0000000000000000FFFF00000100007F", b"0100007F")


def _by_proc(local_port: int, remote_port: int | None) -> list[SocketRow] | None:
    """The same rows from ``/proc/net/tcp6`` and ``/proc/net/tcp``, searched for the address text."""
    found, tables = [], 0
    for name in ("/proc/net/tcp6", "/proc/net/tcp"):
        try:
            data = Path(name).read_bytes()
        except OSError:
            continue
        tables += 1
        for loop in _LOOPBACK_HEX:
            needle = b"%s:%04X %s:" % (loop, local_port, loop)
            if remote_port is not None:
                needle += b"%04X " % remote_port
            at = data.find(needle)
            while at >= 0:
                fields = data[at:data.find(b"\n", at)].split()  # local, remote, st, queues, timer, retr, uid, to, inode
                found.append((int(fields[1].rsplit(b":", 1)[1], 16), int(fields[6]), int(fields[8]),
                              int(fields[2], 16)))
                at = data.find(needle, at + 1)
        if remote_port is not None and found:  # one connection: found in the first table, done
            break
    return found if tables else None
