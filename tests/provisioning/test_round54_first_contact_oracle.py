"""The first contact's error is not a port scanner (review r54, onboard #2).

Before, a node that never proved control failed its verification with the precise transport error: "Connection
refused", "Error reading SSH protocol banner ... Connection reset by peer", "No SSH answer ... within 10s", or
"refused the platform's key", which its provider reads as the job's error and the node's last_error. Any provider
could so ask the platform what listens at any public host and port. Now such a node's provider is told one message,
whatever happened (and the try is not retried at once, so `attempts` tells nothing either); the cause goes to the
server log. A node that proved control keeps the precise message.
"""
import socket
import threading

import pytest
from django.utils import timezone

from marketplace.models import Node
from provisioning.services.nodes import _session_connect
from provisioning.ssh import Timeouts
from provisioning.ssh_errors import NodeUnreachable

from ..marketplace.test_api_nodes import URL, valid_payload

pytestmark = pytest.mark.django_db(transaction=True)  # listener threads

FAST = Timeouts(connect=1.0, attempts=1, backoff=0.0)


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture
def listener():
    """A TCP listener on 127.0.0.1 that answers each connection with `reply` (None: says nothing) and closes."""
    servers = []

    def start(reply: bytes | None) -> int:
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen(5)
        server.settimeout(5)
        servers.append(server)

        def serve():
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:
                    return
                if reply is not None:
                    conn.sendall(reply)
                    conn.close()
                else:
                    threading.Timer(3, conn.close).start()

        threading.Thread(target=serve, daemon=True).start()
        return server.getsockname()[1]

    yield start
    for server in servers:
        server.close()


def _node(api, port: int) -> Node:
    r = api.post(URL, valid_payload(address="127.0.0.1", ssh_port=port), format="json")
    assert r.status_code == 201, r.content
    return Node.objects.get(pk=r.json()["id"])


def _generic(node: Node) -> str:
    return (f"Could not log in to {node.address}:{node.ssh_port} as {node.ssh_user} with the platform's key: check "
            "that the server is up, that the address and SSH port are right and that the node's install command was "
            f"run as {node.ssh_user}, then verify again.")


def _error(node: Node) -> NodeUnreachable:
    with pytest.raises(NodeUnreachable) as caught:
        _session_connect(node, FAST)
    return caught.value


@pytest.mark.parametrize("what", ["closed", "http", "silent"])
def test_an_unproven_node_gets_one_message_whatever_listens_there(api, listener, what):
    port = {"closed": _closed_port, "http": lambda: listener(b"HTTP/1.1 400 Bad Request\r\n\r\n"),
            "silent": lambda: listener(None)}[what]()
    node = _node(api, port)
    error = _error(node)
    assert error.message == _generic(node) == str(error)
    assert f"127.0.0.1:{port}" in error.message and "install command" in error.message
    for detail in ("refused", "reset", "banner", "No SSH answer", "Errno", "within"):
        assert detail not in error.message
    assert error.transient is False  # no Celery retries: `attempts` is the same for every cause


def test_messages_are_the_same_for_a_closed_port_and_a_listener(api, listener):
    closed, http = _closed_port(), listener(b"SSH-garbage\r\n")
    a, b = _error(_node(api, closed)), _error(_node(api, http))
    assert a.message.replace(str(closed), "PORT") == b.message.replace(str(http), "PORT")


def test_a_node_that_proved_control_keeps_the_precise_cause(api):
    node = _node(api, _closed_port())
    Node.objects.filter(pk=node.pk).update(control_proven_at=timezone.now(), host_key_fingerprint="SHA256:x")
    node.refresh_from_db()
    error = _error(node)
    assert error.message != _generic(node)
    assert "Cannot reach" in error.message and error.transient is True
