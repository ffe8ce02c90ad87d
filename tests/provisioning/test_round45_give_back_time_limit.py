"""A check (or reconcile pass) stopped by Celery's soft time limit after its look found a VM lost, but before the
give-back of what a stop, restart or destroy that overtook the interruption billed after the VM's last sighting
(bb5beec). The give-back came last: after every interruption of the health check's batch
(fleet_record._usage_after_loss_given_back), and after the reconciler's interruption transaction or in its loop over
the node's instances. A limit landing in between gave nothing back, and no later check could: its look began after
the stop, so the stop explains the VM's state. Now the give-back is done before any interruption of the batch (for a
stop that came before the check recorded its answer), and in the same transaction as an interruption that finds the
instance no longer running (for one that races it); the reconciler gives back before it judges any instance, and in
its VM-lost transaction. Real services on PostgreSQL; only the moment of the renter's stop and of the limit are
chosen here (the money figures are those of tests/billing/test_vm_lost_stop_race.py)."""
from datetime import UTC, datetime

import pytest
from celery.exceptions import SoftTimeLimitExceeded

from billing.models import BillingEvent, EventKind
from marketplace.models import Instance, InstanceStatus
from marketplace.services import instances as svc
from provisioning.services import fleet_record, reconcile
from provisioning.services.fleet_record import nodes_record_health
from provisioning.services.nodes import HealthResult, running_vm_ids_by_node
from tests.billing import test_vm_lost_stop_race
from tests.billing.conftest import Clock
from tests.billing.helpers import balance
from tests.billing.invariants import assert_billing_invariants
from tests.billing.test_vm_lost_stop_race import (
    ACTED_S,
    FUNDS,
    KEPT,
    _after_the_answer,
    _assert_net_charge_ends_at_since,
    _given_back,
    _renter_does,
    _result,
)
from tests.provisioning.test_reconcile_instances import FakeNode

pytestmark = pytest.mark.django_db
rented = test_vm_lost_stop_race.rented  # the fixture: a lost and a kept instance, a check at `since`, a minute on


@pytest.fixture(autouse=True)
def billing_settings(settings, monkeypatch):
    """As tests/billing/conftest.py sets them: the fee the figures assume, jobs and tasks recorded, not sent."""
    settings.BILLING_REQUIRE_FUNDS = True
    settings.PLATFORM_FEE_PERCENT = 15
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: None)
    monkeypatch.setattr("core.dispatch.send", lambda name, *args, task_id=None: None)
    yield
    assert_billing_invariants()


@pytest.fixture
def clock(monkeypatch):
    c = Clock(datetime(2026, 3, 2, 12, 0, 0, 250_000, tzinfo=UTC))
    monkeypatch.setattr("django.utils.timezone.now", c)
    return c


def _time_limit(*args, **kwargs):
    raise SoftTimeLimitExceeded()


def _both_gone(host, lost, kept, clock) -> HealthResult:
    """The answer of a check probed now: neither instance's VM is on the node."""
    result = _result(host, lost, kept, clock, "gone")
    result.vms.pop(kept.vm_id)
    return result


def _given_once(renter, host, lost, kept) -> None:
    """The renter paid for `lost` up to its VM's last sighting, given back once; `kept` is left to the next check."""
    assert balance(renter) == FUNDS - KEPT, f"charged {FUNDS - balance(renter)}, {KEPT} up to the last sighting"
    assert len(_given_back(lost)) == 1
    assert BillingEvent.objects.filter(user=renter, kind=EventKind.CREDIT, data__instance=lost.pk).count() == 1


@pytest.mark.parametrize("read", ["before-the-stop", "after-the-stop"])
def test_a_stop_before_the_check_recorded_is_given_back_though_the_limit_ends_its_interruptions(
        rented, clock, monkeypatch, read):
    """The renter's stop came after the probe, before the check recorded its answer (the fleet read what runs before
    or after it); the soft limit lands in the check's interruptions. Before, nothing was given back."""
    renter, host, lost, kept, since = rented
    result = _result(host, lost, kept, clock, "gone")
    running = running_vm_ids_by_node(node_ids=[host.pk], probed_before=result.probed_at) \
        if read == "before-the-stop" else None
    clock.advance(ACTED_S)
    svc.instance_stop(instance=Instance.objects.get(pk=lost.pk))
    if running is None:
        running = running_vm_ids_by_node(node_ids=[host.pk], probed_before=result.probed_at)
    real = fleet_record._interrupt
    monkeypatch.setattr(fleet_record, "_interrupt", _time_limit)
    with pytest.raises(SoftTimeLimitExceeded):
        nodes_record_health([result], running_vm_ids=running)
    _assert_net_charge_ends_at_since(renter, host, lost, kept)

    # The next check, with time to finish: nothing more for it.
    monkeypatch.setattr(fleet_record, "_interrupt", real)
    clock.advance(60)
    nodes_record_health([_result(host, lost, kept, clock, "gone")],
                        running_vm_ids=running_vm_ids_by_node(node_ids=[host.pk], probed_before=clock.now))
    _assert_net_charge_ends_at_since(renter, host, lost, kept)


def test_a_stop_racing_its_interruption_is_given_back_though_the_limit_lands_in_the_next_one(
        rented, clock, monkeypatch):
    """Both VMs are gone; the renter's stop of one lands just before the check interrupts (after the fleet read it
    as running), and the soft limit lands in the interruption of the other. Before, the give-back was left to the
    end of the batch, which never came."""
    renter, host, lost, kept, since = rented
    real_judge = fleet_record._interrupt
    _after_the_answer(monkeypatch, _renter_does("stop", lost, clock))
    real = svc.instance_interrupt

    def interrupt(*, instance_id, **kwargs):
        if instance_id == kept.pk:
            raise SoftTimeLimitExceeded()
        return real(instance_id=instance_id, **kwargs)

    monkeypatch.setattr(svc, "instance_interrupt", interrupt)
    result = _both_gone(host, lost, kept, clock)
    clock.advance(1)
    running = running_vm_ids_by_node(node_ids=[host.pk], probed_before=result.probed_at)
    assert running[host.pk] == {lost.vm_id, kept.vm_id}
    with pytest.raises(SoftTimeLimitExceeded):
        nodes_record_health([result], running_vm_ids=running)
    assert Instance.objects.get(pk=lost.pk).status == InstanceStatus.STOPPING
    _given_once(renter, host, lost, kept)
    assert Instance.objects.get(pk=kept.pk).status == InstanceStatus.RUNNING  # the limit came first

    # The next check (its answer recorded only now: the stopped one held the node's last sighting) interrupts the
    # other at that sighting and gives the stopped one nothing more.
    monkeypatch.setattr(fleet_record, "_interrupt", real_judge)
    monkeypatch.setattr(svc, "instance_interrupt", real)
    clock.advance(60)
    result = _both_gone(host, lost, kept, clock)
    clock.advance(1)
    nodes_record_health([result], running_vm_ids=running_vm_ids_by_node(node_ids=[host.pk],
                                                                        probed_before=result.probed_at))
    assert Instance.objects.get(pk=kept.pk).status == InstanceStatus.INTERRUPTED
    _given_once(renter, host, lost, kept)


def test_the_reconciler_gives_back_before_the_limit_ends_its_judging(rented, clock, monkeypatch):
    """The reconciler's pass: both VMs gone; the renter stopped one after the list was asked for. The pass judges the
    newest instance first, and the soft limit lands there. Before, the stopped one's give-back came in its own turn
    of that loop, never reached."""
    renter, host, lost, kept, since = rented
    fake = FakeNode()
    monkeypatch.setattr("provisioning.services.reconcile.node_session", fake.session)
    fake.on_list.append(lambda: (clock.advance(1), _renter_does("stop", lost, clock)()))
    judge = reconcile._running_vm_lost

    def limited(node, instance, *args, **kwargs):
        if instance.pk == kept.pk:
            raise SoftTimeLimitExceeded()
        return judge(node, instance, *args, **kwargs)

    monkeypatch.setattr(reconcile, "_running_vm_lost", limited)
    with pytest.raises(SoftTimeLimitExceeded):
        reconcile.node_reconcile(host)
    assert Instance.objects.get(pk=lost.pk).status == InstanceStatus.STOPPING
    _assert_net_charge_ends_at_since(renter, host, lost, kept)


def test_the_reconcilers_give_back_is_in_its_vm_lost_transaction(rented, clock, monkeypatch):
    """The stop lands as the pass is about to interrupt the instance (after it read it as running): the transaction
    that finds it no longer running gives it back, before anything after it (here, the limit) can end the pass."""
    renter, host, lost, kept, since = rented
    fake = FakeNode()
    fake.vms = {kept.vm_id: "running"}
    monkeypatch.setattr("provisioning.services.reconcile.node_session", fake.session)
    judge = reconcile._running_vm_lost
    act = _renter_does("stop", lost, clock)

    armed = []

    def stopped_first(*args, **kwargs):
        clock.advance(1)
        act()
        armed.append(True)
        return judge(*args, **kwargs)

    monkeypatch.setattr(reconcile, "_running_vm_lost", stopped_first)
    # The soft limit lands as soon as the first transaction the pass opens after the stop ends.
    real_atomic = reconcile.transaction.atomic
    depth = []

    class Atomic:
        def __init__(self, *args, **kwargs):
            self.inner = real_atomic(*args, **kwargs)

        def __enter__(self):
            depth.append(1)
            return self.inner.__enter__()

        def __exit__(self, *exc):
            done = self.inner.__exit__(*exc)
            depth.pop()
            if not exc[0] and not depth and armed:
                armed.clear()
                raise SoftTimeLimitExceeded()
            return done

    monkeypatch.setattr(reconcile.transaction, "atomic", Atomic)
    with pytest.raises(SoftTimeLimitExceeded):
        reconcile.node_reconcile(host)
    monkeypatch.setattr(reconcile.transaction, "atomic", real_atomic)
    _assert_net_charge_ends_at_since(renter, host, lost, kept)

