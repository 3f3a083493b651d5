"""Run a command in a new network namespace whose only interface is loopback (up).

Ray listens on every interface and talks to this machine's own address; in here it has only
127.0.0.1, so nothing it does leaves the machine. Needs root (CAP_SYS_ADMIN). Pure Python
(``unshare(2)`` and an ``ioctl``), so neither ``unshare`` nor ``ip`` needs to be installed.

Usage: python scripts/loopback_namespace.py COMMAND [ARGS...]
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import sys

_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def enter_loopback_namespace() -> None:
    """Move this process into a new network namespace and bring its loopback interface up."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        sys.exit(f"loopback_namespace: unshare(CLONE_NEWNET) failed: {os.strerror(err)}. Run as root.")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    enter_loopback_namespace()
    os.execvp(sys.argv[1], sys.argv[1:])
