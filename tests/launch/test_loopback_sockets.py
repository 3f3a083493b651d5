"""Looking up loopback TCP sockets by port: the kernel's netlink answer, and /proc's where netlink is refused."""

from __future__ import annotations

import os
import socket

import pytest

from nbaccel.launch import loopback_sockets as module
from nbaccel.launch.loopback_sockets import loopback_sockets


@pytest.fixture(params=["v4", "v4-mapped v6"])
def connection(request):
    """A listener, a client connected to it (plain IPv4, or IPv6 talking IPv4 as torch's store client does)."""
    server = socket.create_server(("127.0.0.1", 0))
    if request.param == "v4":
        client = socket.create_connection(server.getsockname())
    else:
        client = socket.socket(socket.AF_INET6)
        client.connect(("::ffff:127.0.0.1", server.getsockname()[1]))
    accepted, _ = server.accept()
    yield server, client, accepted
    for sock in (accepted, client, server):
        sock.close()


def _refuse_netlink(monkeypatch):
    real = socket.socket

    def no_netlink(family=-1, *args, **kwargs):
        if family == socket.AF_NETLINK:
            raise PermissionError(1, "netlink refused here")
        return real(family, *args, **kwargs)

    monkeypatch.setattr(module.socket, "socket", no_netlink)


@pytest.mark.parametrize("source", ["netlink", "/proc"])
def test_a_connection_is_found_with_its_owner_and_inode(connection, source, monkeypatch):
    server, client, _ = connection
    if source == "/proc":
        _refuse_netlink(monkeypatch)
    port, client_port = server.getsockname()[1], client.getsockname()[1]
    rows = loopback_sockets(client_port, port)
    assert rows == [(port, os.getuid(), os.fstat(client.fileno()).st_ino, 1)]
    assert loopback_sockets(client_port, port + 1 if port < 65535 else port - 1) == []  # another connection: none


@pytest.mark.parametrize("source", ["netlink", "/proc"])
def test_every_socket_on_a_port_is_listed_but_the_listener(connection, source, monkeypatch):
    server, client, accepted = connection
    if source == "/proc":
        _refuse_netlink(monkeypatch)
    rows = loopback_sockets(server.getsockname()[1])
    assert [(remote, inode) for remote, _, inode, _ in rows] == [
        (client.getsockname()[1], os.fstat(accepted.fileno()).st_ino)]
