"""A node whose sshd lets the platform in and opens a session channel, then never answers the exec or sftp
request (a frozen host, a provider's fake SSH server; tests/provisioning/hung_sshd.py). paramiko waits for such an
answer with no bound: one such node held its whole health batch (up to FLEET_BATCH_SIZE nodes) every cycle, none of
their checks recorded, dead nodes' renters still billed (found by review). Every channel request is now bounded by
the connect timeout (provisioning.ssh), and a fleet batch waits for its threads for a bounded time only
(provisioning.services.fleet)."""
import threading
import time

import pytest
from django.db import connection

from marketplace.models import Node
from provisioning.services import fleet
from provisioning.services.nodes import HEALTH_TIMEOUTS, HealthResult
from provisioning.ssh import Endpoint, NodeSession, Timeouts, agent_bundle
from provisioning.ssh_errors import AgentTimeout
from provisioning.ssh_pool import SshPool
from tests.billing.helpers import fund, running
from tests.factories import UserFactory, make_listed_node
from tests.provisioning.hung_sshd import HungNode, ed25519_pem
from tests.provisioning.test_fleet_batches import closed_port


@pytest.fixture
def hung():
    node = HungNode()
    yield node
    node.close()


@pytest.fixture
def quick_health(monkeypatch):
    """HEALTH_TIMEOUTS' connect (the bound on a channel request's answer) down to 1 s: a test's wall time."""
    monkeypatch.setattr(HEALTH_TIMEOUTS, "connect", 1)


def _session(hung: HungNode) -> NodeSession:
    endpoint = Endpoint("127.0.0.1", hung.port, "gpumarket", ed25519_pem().encode(), hung.fingerprint)
    return NodeSession(endpoint, Timeouts(connect=1, command=30, attempts=1))


@pytest.mark.parametrize("step", ["sftp", "agent", "exchange", "network test"])
def test_a_channel_request_the_node_never_answers_ends_within_the_connect_timeout(hung, step):
    with _session(hung) as session:
        if step != "sftp":
            session._agent_path = "/home/gpumarket/" + agent_bundle()[1]  # known: no SFTP round trip first
        call = {"sftp": session.ensure_agent, "agent": lambda: session.agent("health"),
                "exchange": lambda: session.exchange("serve"),
                "network test": lambda: session.upload_throughput(1024)}[step]
        start = time.monotonic()
        with pytest.raises(AgentTimeout) as raised:
            call()
        assert time.monotonic() - start < 5  # not the command timeout (30 s), nor forever
    assert "did not answer its" in raised.value.message and "within 1s" in raised.value.message


@pytest.mark.django_db(transaction=True)
def test_one_hung_node_no_longer_holds_back_the_whole_health_batch(hung, quick_health):
    frozen = make_listed_node(address="127.0.0.1", ssh_port=hung.port, host_key_fingerprint=hung.fingerprint)
    dead = make_listed_node(address="127.0.0.1", ssh_port=closed_port())
    renter = UserFactory()
    fund(renter, "50")
    instance = running(renter, dead)
    Node.objects.filter(pk=dead.pk).update(health_failures=1)  # one more miss interrupts its instance
    summary = {}

    def batch_in_a_worker():
        try:
            summary.update(fleet.nodes_health_batch([frozen.pk, dead.pk], cycle="c1", pool=SshPool()))
        finally:
            connection.close()

    batch = threading.Thread(target=batch_in_a_worker, daemon=True)
    batch.start()
    batch.join(timeout=30)
    assert not batch.is_alive(), "the batch still waits for the hung node"
    assert (summary["checked"], summary["failed"], summary["interrupted"]) == (2, 2, 1)
    instance.refresh_from_db()
    frozen.refresh_from_db()
    assert instance.status == "interrupted"
    assert frozen.health_failures == 1 and frozen.last_checked_at is not None
    assert "did not answer its SFTP request within 1s" in frozen.last_error
    # The next cycle checks both (before: `locked`, the hung batch still held their advisory locks).
    nxt = fleet.nodes_health_batch([frozen.pk, dead.pk], cycle="c2", pool=SshPool())
    assert (nxt["locked"], nxt["checked"]) == (0, 2)


def test_a_probe_that_never_ends_is_a_failed_check_and_the_batch_goes_on(db, monkeypatch):
    """The batch's own guard, whatever a probe waits on: past HEALTH_PROBE_DEADLINE_S it is given up and counted
    as a failed check, and the others are recorded (before: the pool waited for every thread)."""
    frozen = make_listed_node(address="127.0.0.1", ssh_port=closed_port())
    dead = make_listed_node(address="127.0.0.1", ssh_port=closed_port())
    renter = UserFactory()
    fund(renter, "50")
    instance = running(renter, dead)
    Node.objects.filter(pk=dead.pk).update(health_failures=1)
    release = threading.Event()
    real = fleet.node_health_probe

    def probe(node, **kwargs):
        if node.pk == frozen.pk:
            release.wait(60)
            return HealthResult(node.pk, True, vms={})
        return real(node, **kwargs)

    monkeypatch.setattr(fleet, "node_health_probe", probe)
    monkeypatch.setattr(fleet, "HEALTH_PROBE_DEADLINE_S", 1.0, raising=False)
    try:
        start = time.monotonic()
        summary = fleet.nodes_health_batch([frozen.pk, dead.pk], pool=SshPool())
        assert time.monotonic() - start < 10
    finally:
        release.set()
    assert (summary["checked"], summary["failed"], summary["interrupted"]) == (2, 2, 1)
    frozen.refresh_from_db()
    instance.refresh_from_db()
    assert frozen.health_failures == 1
    assert frozen.last_error == "The health check got no answer from the node within 1s."
    assert instance.status == "interrupted"


def test_a_reconcile_that_never_ends_is_left_and_the_batch_goes_on(db, monkeypatch):
    frozen, fine = make_listed_node(), make_listed_node()
    release = threading.Event()

    def reconcile(node, pool=None):
        if node.pk == frozen.pk:
            release.wait(60)
        return {"resumed": 0}

    monkeypatch.setattr(fleet, "node_reconcile", reconcile)
    monkeypatch.setattr(fleet, "RECONCILE_DEADLINE_S", 1.0, raising=False)
    try:
        start = time.monotonic()
        summary = fleet.nodes_reconcile_batch([frozen.pk, fine.pk], pool=object())
        assert time.monotonic() - start < 10
    finally:
        release.set()
    assert (summary["nodes"], summary["unfinished"], summary["errors"]) == (1, 1, 0)
