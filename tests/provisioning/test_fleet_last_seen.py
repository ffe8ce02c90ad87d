"""A node's last_seen_at is when it answered (its probe's time), not when the batch recorded it (found by review:
billing closes there when its instances are interrupted, so renters paid for the time the batch took)."""
import threading
from datetime import timedelta

from django.utils import timezone

from marketplace.models import Instance
from provisioning.services import fleet
from provisioning.services.fleet_record import nodes_record_health
from provisioning.services.nodes import HealthResult
from provisioning.ssh_pool import SshPool
from tests.billing.helpers import fund, running
from tests.factories import UserFactory, make_listed_node


def test_last_seen_at_is_when_the_node_answered_not_when_the_batch_recorded_it(db, monkeypatch):
    answering, hung = make_listed_node(), make_listed_node()
    renter = UserFactory()
    fund(renter, "50")
    instance = running(renter, answering)
    # Running for a while: the interruption has whole seconds to bill up to the node's last healthy moment.
    Instance.objects.filter(pk=instance.pk).update(started_at=timezone.now() - timedelta(minutes=10))
    answered = {}
    release = threading.Event()

    def probe(node, **kwargs):
        if node.pk == hung.pk:
            release.wait(30)
            return HealthResult(node.pk, False, "late")
        probed_at = timezone.now()
        answered[node.pk] = timezone.now()
        return HealthResult(node.pk, True, vms={instance.vm_id: "running"}, probed_at=probed_at, seconds=0.0)
    monkeypatch.setattr(fleet, "node_health_probe", probe)
    monkeypatch.setattr(fleet, "HEALTH_PROBE_DEADLINE_S", 3.0)
    try:
        fleet.nodes_health_batch([answering.pk, hung.pk], pool=SshPool())
    finally:
        release.set()
    answering.refresh_from_db()
    late = (answering.last_seen_at - answered[answering.pk]).total_seconds()
    for _ in range(2):
        nodes_record_health([HealthResult(answering.pk, False, "No SSH answer")], running_vm_ids={})
    instance.refresh_from_db()
    assert instance.status == "interrupted"
    billed_past = (instance.billed_until - answered[answering.pk]).total_seconds()
    assert billed_past < 0.5, (f"billed {billed_past:.1f} s past the node's last answer "
                               f"(last_seen_at {late:.1f} s after it)")


def test_an_answer_probed_before_the_last_one_recorded_does_not_move_last_seen_at_back(db):
    node = make_listed_node()
    now = timezone.now()
    nodes_record_health([HealthResult(node.pk, True, vms={}, probed_at=now)], running_vm_ids={})
    nodes_record_health([HealthResult(node.pk, True, vms={}, probed_at=now - timedelta(seconds=30))],
                        running_vm_ids={})
    node.refresh_from_db()
    assert node.last_seen_at == now
    # An answer with no time of its own counts as answered when recorded.
    nodes_record_health([HealthResult(node.pk, True, vms={})], running_vm_ids={})
    node.refresh_from_db()
    assert node.last_seen_at > now
