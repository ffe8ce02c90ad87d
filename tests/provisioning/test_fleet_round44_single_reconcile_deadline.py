"""A health batch's recovering node alone in its batch is reconciled under the batch's deadline
(HEALTH_RECONCILE_DEADLINE_S) as several are (c7c2f67): it ran in the batch's own thread with no deadline, so a node
that answered its probe and then hung (a slot wait of 60 s, SSH steps of up to 120 s each) kept the batch past the
deadline, into Celery's soft time limit, which then cut the reconcile wherever it was. The node here answers its
health probe, then its SSH server never answers a channel request again (tests/provisioning/hung_sshd.py)."""
import threading
import time

import pytest
from django.db import connection
from django.utils import timezone

from marketplace.models import Node, NodeState
from provisioning.services import fleet
from provisioning.services.nodes import HealthResult
from provisioning.ssh_pool import SshPool
from tests.factories import make_listed_node
from tests.provisioning.hung_sshd import HungNode

DEADLINE_S = 2.0


@pytest.fixture
def hung():
    node = HungNode()
    yield node
    node.close()


@pytest.mark.django_db(transaction=True)  # as the task runs it: the batch's threads see what the test wrote
def test_a_recovering_node_alone_in_its_batch_is_reconciled_within_the_batchs_deadline(hung, monkeypatch):
    back = make_listed_node(address="127.0.0.1", ssh_port=hung.port, host_key_fingerprint=hung.fingerprint)
    Node.objects.filter(pk=back.pk).update(state=NodeState.OFFLINE, health_failures=3)
    # It answered its probe (the node is back); its SSH server hangs from then on, for the reconcile.
    monkeypatch.setattr(fleet, "nodes_probe", lambda nodes, parallelism, pool=None: [
        HealthResult(n.pk, True, vms={}, probed_at=timezone.now()) for n in nodes])
    monkeypatch.setattr(fleet, "HEALTH_RECONCILE_DEADLINE_S", DEADLINE_S)
    summary, took = {}, []

    def batch_in_a_worker():
        start = time.monotonic()
        try:
            summary.update(fleet.nodes_health_batch([back.pk], cycle="round44-single", pool=SshPool()))
        finally:
            took.append(time.monotonic() - start)
            connection.close()

    batch = threading.Thread(target=batch_in_a_worker, daemon=True)
    batch.start()
    batch.join(timeout=60)
    assert not batch.is_alive() and took
    assert took[0] < DEADLINE_S + 3, f"the batch waited {took[0]:.1f} s for its one reconcile, past its deadline"
    assert summary["unfinished"] == 1 and summary["failed"] == 0
    back.refresh_from_db()
    # Not reconciled in time: not recorded (it must not take rentals before it is reconciled); the next check does it.
    assert (back.state, back.health_failures) == (NodeState.OFFLINE, 3)
