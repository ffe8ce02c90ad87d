"""The reconciler's list finds a VM (or a stopped VM's disk) gone, while a health check begun after the list was asked
for, that judged nothing of the VM, is recorded, and a meter tick follows it: the run (or the disk) is billed up to
that check, past the list. The reconciler bills no further than the list (reconcile._last_sighting); what the tick
billed after it is given back, as the health check gives it back in the same race (fleet_record)."""
from datetime import UTC, datetime

import pytest

from billing.selectors import instance_cost
from billing.services.metering import usage_meter
from billing.services.storage import storage_cost, storage_meter
from marketplace.models import Instance, InstanceStatus
from provisioning.services.fleet_record import node_record_health
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


def _instance():
    renter = UserFactory()
    fund(renter, "20")
    host = node("1.000000")
    host.disk_price_per_gb_month_micros = PRICE
    host.save()
    return running(renter, host), host


def _check_and_tick_while_listing(clock, fake, host, instance) -> dict:
    """While the node answers the list: a health check probed after the list was asked for, its answer listing the
    VM in a state its engine cannot give (judged by nothing), recorded; then the meters tick. Returns when the list
    was asked."""
    asked = {}

    def check():
        asked["at"] = clock.now
        clock.advance(5)
        node_record_health(node_id=host.pk, ok=True, vms={instance.vm_id: "unknown"}, probed_at=clock.now)
        clock.advance(2)
        usage_meter()
        storage_meter()
        clock.advance(3)

    fake.on_list.append(check)
    return asked


def test_a_stopped_disk_ticked_past_the_list_that_found_it_gone_is_given_back(clock, fake):
    instance, host = _instance()
    clock.advance(60)
    instance = stop(instance)
    stopped_at = Instance.objects.get(pk=instance.pk).stopped_at
    clock.advance(300)
    node_record_health(node_id=host.pk, ok=True, vms={instance.vm_id: "stopped"}, probed_at=clock.now)
    clock.advance(45)
    asked = _check_and_tick_while_listing(clock, fake, host, instance)  # the fake lists no VM
    node_reconcile(Instance.objects.get(pk=instance.pk).node)
    failed = Instance.objects.get(pk=instance.pk)
    assert failed.status == InstanceStatus.FAILED
    seconds = int((asked["at"] - stopped_at).total_seconds())
    paid = instance_cost(instance=failed)["disk_amount_micros"]
    assert paid == storage_cost(size_gb=failed.disk_gb, price_per_gb_month_micros=PRICE, seconds=seconds), \
        f"{paid} µ$ paid for the disk, {seconds} s up to the list that found it gone"
    assert_billing_invariants()


def test_a_run_ticked_past_the_list_that_found_its_vm_gone_is_given_back(clock, fake):
    instance, host = _instance()
    started_at = Instance.objects.get(pk=instance.pk).started_at
    clock.advance(300)
    node_record_health(node_id=host.pk, ok=True, vms={instance.vm_id: "running"}, probed_at=clock.now)
    clock.advance(45)
    asked = _check_and_tick_while_listing(clock, fake, host, instance)  # the fake lists no VM
    node_reconcile(Instance.objects.get(pk=instance.pk).node)
    lost = Instance.objects.get(pk=instance.pk)
    assert lost.status == InstanceStatus.FAILED
    seconds = int((asked["at"] - started_at).total_seconds())
    paid = instance_cost(instance=lost)["billed_seconds"]
    assert paid == seconds, f"{paid} s paid for, {seconds} s up to the list that found the VM gone"
    assert_billing_invariants()
