"""The rule of where nodes may be (core/addresses.py), at every connection the platform opens to a node
(provisioning.ssh.checked_connection): the address is resolved once, every address it has is checked, and the
socket goes to the checked address. Before, the worker connected to whatever a node's row said, at whatever its
name resolved to at that moment: a name that resolved to a public address at registration and to a private one
later (DNS rebinding), or a node registered before the rule, reached inside the platform's network.

A refused address opens no socket, fails a job at once (AddressRefused: not retried) and a health check as an
unreachable node's, with a reason the provider can act on as the node's last error. The nodes here are registered
while loopback is allowed (the tests' settings); then the setting is emptied, as on a platform that takes public
addresses only. The servers are real: an sshd that accepts the node's key, or a TCP listener that counts what
reaches it."""
import socket
import threading
import time
from contextlib import closing

import pytest
from celery.exceptions import Retry

from marketplace.models import Node, NodeState
from provisioning import sim, tasks
from provisioning.models import Job, JobStatus, NodeEvent
from provisioning.services import fleet
from provisioning.services.nodes import OFFLINE_AFTER_FAILED_CHECKS, node_endpoint, node_health_probe
from provisioning.services.verification import node_verify_request
from provisioning.ssh import NodeSession, Timeouts, checked_connection
from provisioning.ssh_errors import AddressRefused, NodeUnreachable
from provisioning.ssh_pool import SshPool
from tests.factories import UserFactory, make_listed_node, make_node

from .test_vm_job_failures import run_in_worker

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

REFUSED = "is a loopback address, and the platform connects only to servers at public addresses"


@pytest.fixture
def simbase(tmp_path_factory):
    base = tmp_path_factory.mktemp("address-simnodes")
    yield base
    sim.nodes_down(base)


def sim_node(simbase, address=None):
    """A listed node backed by a real sshd that takes the node's key: (node, info)."""
    info = sim.node_up("rtx-a4000-x2", simbase)
    node = make_listed_node(UserFactory(), gpu_model="rtx-a4000", gpu_count=2, address=address or info["address"],
                            ssh_port=info["ssh_port"], ssh_user=info["ssh_user"],
                            host_key_fingerprint=info["host_key_fingerprint"])
    sim.node_authorize(info["ssh_port"], node.ssh_public_key, simbase)
    return node


@pytest.fixture
def listener():
    """A TCP server on loopback that accepts nothing by itself: a connection made to it waits in its backlog."""
    with closing(socket.create_server(("127.0.0.1", 0))) as server:
        yield server


def reached(server) -> int:
    """How many connections reached `server` (taken out of its backlog)."""
    server.settimeout(0.3)
    count = 0
    while True:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            return count
        conn.close()
        count += 1


def test_an_sshd_that_would_answer_is_not_connected_to_once_its_address_is_refused(simbase, settings):
    node = sim_node(simbase)
    assert node_health_probe(node).ok  # the sshd takes the node's key: a connection would succeed
    settings.NODE_ADDRESS_ALLOWED_NETWORKS = []
    result = node_health_probe(node)
    assert not result.ok and not result.busy
    assert f"127.0.0.1 {REFUSED}" in result.error and "No connection was opened" in result.error, result.error


def test_a_name_that_now_resolves_to_a_refused_address_is_not_connected_to(simbase, settings):
    """Registered by name while it resolved to an allowed address (here loopback, allowed); its answer is now one
    the platform does not connect to: the check at the connection catches it, naming what it resolves to."""
    node = sim_node(simbase, address="localhost")
    assert node_health_probe(node).ok  # the host key is still checked against the pin, by the registered name
    settings.NODE_ADDRESS_ALLOWED_NETWORKS = []
    result = node_health_probe(node)
    assert not result.ok and "localhost resolves to " in result.error and "loopback address" in result.error
    assert "Point localhost at the server's public address again" in result.error, result.error


@pytest.mark.parametrize("address", ["127.0.0.1", "localhost"])
def test_no_socket_is_opened_to_a_refused_address(listener, settings, address):
    node = make_node(address=address, ssh_port=listener.getsockname()[1])
    endpoint = node_endpoint(node)
    with pytest.raises(NodeUnreachable):  # allowed: it connects (and finds no SSH server there)
        NodeSession(endpoint, Timeouts(connect=1, attempts=1)).connect()
    assert reached(listener) == 1
    settings.NODE_ADDRESS_ALLOWED_NETWORKS = []
    start = time.monotonic()
    with pytest.raises(AddressRefused) as refused:
        NodeSession(endpoint, Timeouts(connect=1, attempts=3, backoff=5)).connect()
    assert time.monotonic() - start < 4  # one try, not three with 5 s and 10 s between them
    assert REFUSED in refused.value.message and not refused.value.transient
    assert reached(listener) == 0


def test_a_slow_name_server_is_bounded_by_the_connections_timeout(monkeypatch):
    """The name is looked up within the connection's own timeout (getaddrinfo has none: a provider's slow name
    server held the worker, which also runs the fleet's health checks): unreachable, retried as such."""
    released = threading.Event()
    real = socket.getaddrinfo

    def slow(host, *args, **kwargs):
        if host == "slow.example.net":
            released.wait(5)
        return real("127.0.0.1", *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    try:
        with pytest.raises(NodeUnreachable) as unreachable:
            checked_connection("slow.example.net", 22, 0.5)
    finally:
        released.set()
    assert "could not resolve slow.example.net within 0.5 s" in unreachable.value.message


def test_the_health_checks_report_it_and_take_the_node_offline(simbase, settings):
    """The fleet's health check (batch, kept connections) counts it as a failed check with the reason as the node's
    last error, which the provider and operators read; after the usual number in a row the node goes offline with
    an event saying why. Nothing is skipped silently."""
    node = sim_node(simbase)
    pool = SshPool()
    try:
        assert fleet.nodes_health_batch([node.pk], pool=pool)["failed"] == 0
        pool.close_all()  # a worker restarted with the new setting keeps no connection from before
        settings.NODE_ADDRESS_ALLOWED_NETWORKS = []
        for _ in range(OFFLINE_AFTER_FAILED_CHECKS):
            assert fleet.nodes_health_batch([node.pk], pool=pool)["failed"] == 1
    finally:
        pool.close_all()
    node = Node.objects.get(pk=node.pk)
    assert node.state == NodeState.OFFLINE and node.health_failures == OFFLINE_AFTER_FAILED_CHECKS
    assert f"127.0.0.1 {REFUSED}" in node.last_error
    offline = NodeEvent.objects.get(node=node, kind="offline")
    assert REFUSED in offline.message
    assert pool.connects == 1  # the one before the setting changed


def test_a_job_on_such_a_node_fails_at_once_naming_why(listener, settings, broker):
    """Not retried (it stays so until the DNS records or the setting change), not a crash: the verification ends
    as failed with the reason, and the node says it."""
    node = make_node(address="127.0.0.1", ssh_port=listener.getsockname()[1])
    settings.NODE_ADDRESS_ALLOWED_NETWORKS = []
    job = node_verify_request(node=node)
    try:
        run_in_worker(tasks.node_verify, job)
    except Retry:
        pytest.fail("a refused address was retried")
    job = Job.objects.get(pk=job.pk)
    assert job.status == JobStatus.FAILED and REFUSED in job.error, job.error
    node = Node.objects.get(pk=node.pk)
    assert node.state == NodeState.PENDING and REFUSED in node.last_error
    assert reached(listener) == 0

