"""A stopped instance whose VM and disk the node no longer lists is billed for its disk only up to the last health
check that still listed the VM. Before the fix (reproduced in 2627888, strict xfail), the health checks listed the
node's VMs (stopped ones too) but judged only running ones: they moved the node's last_seen_at on, the storage meter
billed the vanished disk up to each of them, and the reconciler failed the instance with its disk billed up to its
own pass (here 1,230 s of disk billed, 600 s up to the last check that listed the VM). Now the health check fails a
stopped instance (stopped before its probe) whose VM its answer does not list, or lists missing, with its disk billed
up to the node's previous answer (fleet_record._stopped_vms_lost), before the node's last_seen_at moves on; the
reconciler, meeting one first, bills it up to the node's last health check (reconcile._judge_stopped)."""
from datetime import UTC, datetime, timedelta

import pytest

from billing.models import AccountKind, LedgerTransaction, TransactionKind
from billing.services.ledger import earnings_balance, platform_account
from billing.services.storage import storage_cost, storage_meter
from marketplace.models import Instance, InstanceStatus
from provisioning.services.fleet_record import node_record_health
from provisioning.services.reconcile import node_reconcile
from tests.billing.conftest import Clock
from tests.billing.helpers import balance, fund, node, running, stop
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


def test_a_stopped_instances_vanished_disk_is_billed_only_up_to_its_last_sighting(clock, monkeypatch):
    renter = UserFactory()
    fund(renter, "20")
    host = node("1.000000")
    host.disk_price_per_gb_month_micros = PRICE
    host.save()
    instance = running(renter, host)
    clock.advance(60)
    instance = stop(instance)
    stopped_at = Instance.objects.get(pk=instance.pk).stopped_at
    fake = FakeNode()
    monkeypatch.setattr("provisioning.services.reconcile.node_session", fake.session)
    # A health check lists its VM, stopped: its last sighting.
    clock.advance(600)
    node_record_health(node_id=host.pk, ok=True, vms={instance.vm_id: "stopped"}, probed_at=clock.now)
    last_sighting = clock.now
    storage_meter()
    # Its VM and disk are removed on the node; the next health checks list no VM; the meter ticks on.
    for _ in range(10):
        clock.advance(60)
        node_record_health(node_id=host.pk, ok=True, vms={}, probed_at=clock.now)
        storage_meter()
    clock.advance(30)
    node_reconcile(host)
    instance = Instance.objects.get(pk=instance.pk)
    assert instance.status == InstanceStatus.FAILED
    seconds = int((last_sighting - stopped_at).total_seconds())
    assert instance.disk_cost_micros == storage_cost(size_gb=instance.disk_gb, price_per_gb_month_micros=PRICE,
                                                     seconds=seconds), \
        (f"billed {instance.disk_billed_seconds} s of disk, {seconds} s up to its last sighting "
         f"({timedelta(seconds=instance.disk_billed_seconds - seconds)} after it)")


def _stopped(clock, *, size_gb: int | None = None):
    """A funded renter's instance on a node with a disk price, stopped 60 s after it started; (instance, node)."""
    renter = UserFactory()
    fund(renter, "20")
    host = node("1.000000")
    host.disk_price_per_gb_month_micros = PRICE
    host.save()
    instance = running(renter, host)
    if size_gb is not None:
        Instance.objects.filter(pk=instance.pk).update(disk_gb=size_gb)
        instance.refresh_from_db()
    clock.advance(60)
    return stop(instance), host


def _disk_cost(instance, seconds: int) -> int:
    return storage_cost(size_gb=instance.disk_gb, price_per_gb_month_micros=PRICE, seconds=seconds)


def _money(renter, provider_id: int) -> tuple[int, int, int]:
    """The renter's wallet, the provider's earnings and the platform's revenue (µ$)."""
    revenue = platform_account(kind=AccountKind.PLATFORM_REVENUE)
    return balance(renter), earnings_balance(user_id=provider_id), revenue.balance_micros


def test_the_disk_is_charged_once_up_to_the_sighting_whatever_passes_follow(clock, monkeypatch):
    instance, host = _stopped(clock, size_gb=500)
    renter = instance.renter
    before = _money(renter, host.provider_id)
    stopped_at = Instance.objects.get(pk=instance.pk).stopped_at
    fake = FakeNode()
    monkeypatch.setattr("provisioning.services.reconcile.node_session", fake.session)
    clock.advance(300)
    node_record_health(node_id=host.pk, ok=True, vms={instance.vm_id: "stopped"}, probed_at=clock.now)
    sighting = clock.now
    clock.advance(60)
    # Its record on the node says missing (its container or domain removed there): gone, as one not listed.
    assert node_record_health(node_id=host.pk, ok=True, vms={instance.vm_id: "missing"}, probed_at=clock.now) == []
    failed = Instance.objects.get(pk=instance.pk)
    assert failed.status == InstanceStatus.FAILED
    seconds = int((sighting - stopped_at).total_seconds())
    cost = _disk_cost(failed, seconds)
    assert cost > 0 and failed.disk_billed_seconds == seconds and failed.disk_cost_micros == cost
    for _ in range(3):  # more checks, ticks and passes, a repeated answer among them: nothing more
        node_record_health(node_id=host.pk, ok=True, vms={instance.vm_id: "missing"}, probed_at=clock.now)
        clock.advance(60)
        node_record_health(node_id=host.pk, ok=True, vms={}, probed_at=clock.now)
        storage_meter()
        node_reconcile(host)
    again = Instance.objects.get(pk=instance.pk)
    assert (again.status, again.disk_billed_seconds, again.disk_cost_micros) == (InstanceStatus.FAILED, seconds, cost)
    after = _money(renter, host.provider_id)
    fee = cost * instance.platform_fee_bps // 10_000
    assert (before[0] - after[0], after[1] - before[1], after[2] - before[2]) == (cost, cost - fee, fee)
    charged = LedgerTransaction.objects.filter(kind=TransactionKind.STORAGE,
                                               idempotency_key__startswith=f"storage:disk:{instance.pk}:")
    assert sum(-e.amount_micros for t in charged for e in t.entries.all() if e.amount_micros < 0) == cost
    assert_billing_invariants()


def test_a_listed_stopped_vm_changes_nothing_and_its_disk_is_billed_up_to_each_check(clock):
    instance, host = _stopped(clock)
    stopped_at = Instance.objects.get(pk=instance.pk).stopped_at
    for _ in range(5):
        clock.advance(120)
        assert node_record_health(node_id=host.pk, ok=True, vms={instance.vm_id: "stopped"},
                                  probed_at=clock.now) == []
        storage_meter()
    kept = Instance.objects.get(pk=instance.pk)
    assert kept.status == InstanceStatus.STOPPED and kept.status_message == instance.status_message
    assert kept.disk_billed_seconds == int((clock.now - stopped_at).total_seconds()) == 600
    assert kept.disk_cost_micros == _disk_cost(kept, 600)
    assert_billing_invariants()


def test_a_vm_the_engine_cannot_read_for_a_while_then_lists_again_loses_no_charge(clock):
    """An answer that lists the VM in a state the engine cannot give (unknown) judges nothing; nor does a failed
    check, nor an answer without probe time. Listed again, the disk is billed up to the latest check, none lost."""
    instance, host = _stopped(clock)
    stopped_at = Instance.objects.get(pk=instance.pk).stopped_at
    clock.advance(120)
    node_record_health(node_id=host.pk, ok=True, vms={instance.vm_id: "stopped"}, probed_at=clock.now)
    clock.advance(120)
    node_record_health(node_id=host.pk, ok=True, vms={instance.vm_id: "unknown"}, probed_at=clock.now)
    storage_meter()
    clock.advance(120)
    node_record_health(node_id=host.pk, ok=False, error="timed out", probed_at=clock.now)
    storage_meter()
    assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.STOPPED
    clock.advance(120)
    node_record_health(node_id=host.pk, ok=True, vms={instance.vm_id: "stopped"}, probed_at=clock.now)
    storage_meter()
    kept = Instance.objects.get(pk=instance.pk)
    assert kept.status == InstanceStatus.STOPPED
    assert kept.disk_billed_seconds == int((clock.now - stopped_at).total_seconds()) == 480
    assert kept.disk_cost_micros == _disk_cost(kept, 480)
    assert_billing_invariants()


def test_an_instance_stopped_after_the_probe_is_not_judged_by_that_answer(clock):
    """A stop that came after the probe began: the answer saw its VM running, or (not yet listed) not at all, and
    says nothing of its disk; it is left stopped and billed on."""
    renter = UserFactory()
    fund(renter, "20")
    host = node("1.000000")
    host.disk_price_per_gb_month_micros = PRICE
    host.save()
    instance = running(renter, host)
    clock.advance(60)
    probed_at = clock.now
    clock.advance(5)
    instance = stop(instance)
    node_record_health(node_id=host.pk, ok=True, vms={}, probed_at=probed_at, running_vm_ids=set())
    assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.STOPPED
    assert_billing_invariants()


def test_the_reconciler_meeting_it_first_bills_the_disk_up_to_the_last_check(clock, monkeypatch):
    """No health check between the VM's removal and the reconciler's pass: the pass fails the instance with its
    disk billed up to the node's last check (which listed the VM), not up to the pass."""
    instance, host = _stopped(clock)
    stopped_at = Instance.objects.get(pk=instance.pk).stopped_at
    fake = FakeNode()
    monkeypatch.setattr("provisioning.services.reconcile.node_session", fake.session)
    clock.advance(300)
    node_record_health(node_id=host.pk, ok=True, vms={instance.vm_id: "stopped"}, probed_at=clock.now)
    sighting = clock.now
    clock.advance(45)
    node_reconcile(Instance.objects.get(pk=instance.pk).node)
    failed = Instance.objects.get(pk=instance.pk)
    assert failed.status == InstanceStatus.FAILED
    seconds = int((sighting - stopped_at).total_seconds())
    assert failed.disk_billed_seconds == seconds and failed.disk_cost_micros == _disk_cost(failed, seconds)
    assert_billing_invariants()
