"""Announced maintenance in the reliability figure (fleet_record.announced_downtime): a provider who puts a node
into maintenance and powers it off is not marked down as for an unannounced outage, unless renters are on it."""
import pytest
from django.utils import timezone

from marketplace.models import InstanceStatus, NodeState
from marketplace.services.nodes import node_update
from provisioning.models import HealthSample
from provisioning.services.fleet_record import nodes_record_health
from provisioning.services.nodes import HealthResult
from tests.billing.helpers import fund, running
from tests.factories import UserFactory, make_listed_node


@pytest.fixture(autouse=True)
def sent_jobs(monkeypatch):
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: None)


def _checks(node, ok: bool, n: int = 10):
    for _ in range(n):
        result = HealthResult(node.pk, True, vms={}, probed_at=timezone.now()) if ok \
            else HealthResult(node.pk, False, "No SSH answer")
        nodes_record_health([result], running_vm_ids={})
    node.refresh_from_db()


def _sample(node):
    return HealthSample.objects.filter(node=node).values_list("ok", "failed").get()


def test_announced_maintenance_is_not_counted_as_downtime(db):
    node = make_listed_node()
    _checks(node, ok=True)
    node_update(node=node, maintenance=True)
    _checks(node, ok=False)
    assert node.state == NodeState.MAINTENANCE and node.reliability == 1.0  # before: 0.5
    assert _sample(node) == (10, 0)
    assert node.health_failures == 10  # still failures in a row: it comes back offline, reconciled first
    node_update(node=node, maintenance=False)
    node.refresh_from_db()
    assert node.state == NodeState.OFFLINE
    _checks(node, ok=False, n=10)  # out of maintenance: counted again
    assert node.reliability == 0.5 and _sample(node) == (10, 10)


def test_maintenance_with_renters_on_it_counts_as_downtime(db):
    """node_update(maintenance=True) neither refuses nor interrupts running instances: their renters live the
    outage (interrupted by the checks as on any node), so maintenance must not hide it from the figure."""
    node = make_listed_node()
    renter = UserFactory()
    fund(renter, "50")
    instance = running(renter, node)
    _checks(node, ok=True)
    node_update(node=node, maintenance=True)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.RUNNING
    _checks(node, ok=False)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.INTERRUPTED
    assert node.reliability == 0.5 and _sample(node) == (10, 10)
