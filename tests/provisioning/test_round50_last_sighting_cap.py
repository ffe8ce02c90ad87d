"""The reconciler bills a VM it finds gone only up to its last sighting, never past its own list. Before the fix it
read the node's last_seen_at as that sighting, uncapped: a health check recorded while the node answered the list
(probed after the list was asked for, its answer not judging the VM: the engine could not give its state) moved
last_seen_at on, and a stopped instance's vanished disk (reconcile._judge_stopped) or a running instance's lost run
(reconcile._running_vm_lost) was billed up to that check, past the list that found the VM gone. Now both are
capped at the list, as the pass's give-backs already were (reconcile._given_back_after_list,
_disk_given_back_after_list): the node's last health check, or the list itself when a check recorded since."""

from datetime import UTC, datetime

import pytest

from billing.services.storage import storage_cost, storage_meter
from marketplace.models import Gpu, Instance, InstanceStatus, Node
from provisioning.services.fleet_record import node_record_health
from provisioning.services.nodes import node_apply_inventory
from provisioning.services.reconcile import node_reconcile
from tests.billing.conftest import Clock
from tests.billing.helpers import fund, node, running, stop
from tests.billing.invariants import assert_billing_invariants
from tests.factories import UserFactory
from tests.provisioning.test_reconcile_instances import FakeNode

pytestmark = pytest.mark.django_db
PRICE = 300_000  # µ$ per GB-month


@pytest.fixture
def clock(monkeypatch):
    c = Clock(datetime(2026, 3, 2, 12, 0, 0, 250_000, tzinfo=UTC))
    monkeypatch.setattr("django.utils.timezone.now", c)
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: None)
    monkeypatch.setattr("core.dispatch.send", lambda name, *args, task_id=None: None)
    return c


@pytest.fixture
def fake(monkeypatch):
    f = FakeNode()
    monkeypatch.setattr("provisioning.services.reconcile.node_session", f.session)
    return f


def _instance(clock):
    renter = UserFactory()
    fund(renter, "20")
    host = node("1.000000")
    host.disk_price_per_gb_month_micros = PRICE
    host.save()
    return running(renter, host), host


def _check_while_listing(clock, fake, host, instance) -> dict:
    """While the node answers the list: a health check, probed after the list was asked for, whose answer lists the
    VM in a state its engine cannot give (unknown: judged by nothing), recorded. Returns when the list was asked."""
    asked = {}

    def check():
        asked["at"] = clock.now
        clock.advance(5)
        node_record_health(node_id=host.pk, ok=True, vms={instance.vm_id: "unknown"}, probed_at=clock.now)
        clock.advance(5)

    fake.on_list.append(check)
    return asked


def test_a_stopped_instances_vanished_disk_is_billed_no_further_than_the_list(clock, fake):
    instance, host = _instance(clock)
    clock.advance(60)
    instance = stop(instance)
    stopped_at = Instance.objects.get(pk=instance.pk).stopped_at
    clock.advance(300)
    node_record_health(node_id=host.pk, ok=True, vms={instance.vm_id: "stopped"}, probed_at=clock.now)
    clock.advance(45)
    asked = _check_while_listing(clock, fake, host, instance)  # its VM and disk are gone: the fake lists no VM
    node_reconcile(Instance.objects.get(pk=instance.pk).node)
    failed = Instance.objects.get(pk=instance.pk)
    assert failed.status == InstanceStatus.FAILED
    seconds = int((asked["at"] - stopped_at).total_seconds())
    assert failed.disk_billed_seconds == seconds, (
        f"disk billed {failed.disk_billed_seconds - seconds} s past the list that found it gone"
    )
    assert failed.disk_cost_micros == storage_cost(
        size_gb=failed.disk_gb, price_per_gb_month_micros=PRICE, seconds=seconds
    )
    assert_billing_invariants()


def test_a_running_instances_lost_vm_is_billed_no_further_than_the_list(clock, fake):
    instance, host = _instance(clock)
    clock.advance(300)
    node_record_health(node_id=host.pk, ok=True, vms={instance.vm_id: "running"}, probed_at=clock.now)
    clock.advance(45)
    asked = _check_while_listing(clock, fake, host, instance)  # its VM is gone: the fake lists no VM
    node_reconcile(Instance.objects.get(pk=instance.pk).node)
    lost = Instance.objects.get(pk=instance.pk)
    assert lost.status == InstanceStatus.FAILED
    assert lost.billed_until == asked["at"], (
        f"billed {(lost.billed_until - asked['at']).total_seconds()} s past the list that found the VM gone"
    )
    assert_billing_invariants()


def test_a_verification_is_not_the_last_sighting_of_a_stopped_vms_disk(clock):
    """A verification of a node with a stopped instance (and no running one) set last_seen_at to its own moment: it
    reads the node's GPUs, not its VMs, yet the storage meter bills a stopped disk up to last_seen_at, and the check
    that then found the VM and its disk gone billed the disk up to the verification (its `last_healthy`), past the
    last answer that listed the VM. Now a verification leaves last_seen_at alone while a stopped instance's disk is
    billed on the node, as it does while renters run on it (nodes._apply_inventory)."""
    instance, host = _instance(clock)
    for gpu in Gpu.objects.filter(node=host):
        Gpu.objects.filter(pk=gpu.pk).update(uuid=f"GPU-{host.pk}-{gpu.index}")
    clock.advance(60)
    instance = stop(instance)
    stopped_at = Instance.objects.get(pk=instance.pk).stopped_at
    clock.advance(300)
    node_record_health(node_id=host.pk, ok=True, vms={instance.vm_id: "stopped"}, probed_at=clock.now)
    sighting = clock.now
    clock.advance(60)
    gpus = [
        {"index": index, "uuid": uuid, "name": "x"}
        for index, uuid in Gpu.objects.filter(node=host).order_by("index").values_list("index", "uuid")
    ]
    node_apply_inventory(node=Node.objects.get(pk=host.pk), inventory={"gpus": gpus})
    storage_meter()
    clock.advance(60)
    node_record_health(node_id=host.pk, ok=True, vms={}, probed_at=clock.now)  # its VM and disk are gone
    failed = Instance.objects.get(pk=instance.pk)
    assert failed.status == InstanceStatus.FAILED
    seconds = int((sighting - stopped_at).total_seconds())
    assert failed.disk_billed_seconds == seconds, (
        f"disk billed {failed.disk_billed_seconds - seconds} s past the last answer that listed its VM"
    )
    assert failed.disk_cost_micros == storage_cost(
        size_gb=failed.disk_gb, price_per_gb_month_micros=PRICE, seconds=seconds
    )
    assert_billing_invariants()


def test_a_verification_still_moves_last_seen_at_of_a_node_with_no_renter(clock):
    _, host = _instance(clock)
    Instance.objects.filter(node=host).update(status=InstanceStatus.DESTROYED)
    clock.advance(60)
    node_apply_inventory(node=Node.objects.get(pk=host.pk), inventory={"gpus": []})
    assert Node.objects.get(pk=host.pk).last_seen_at == clock.now
