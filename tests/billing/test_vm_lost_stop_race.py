"""A renter's stop (or destroy, or restart) between a look at the node that finds the instance's VM lost and the
interruption that look leads to. The health check's answer (or the reconciler's list) shows the VM gone; the
interruption would close billing at the VM's last sighting (`since`, the node's previous health check); but the
renter's stop came first and closed billing up to its own moment (the node answers, so node_billable_until is
`now`), and the interruption, finding the instance no longer running, did nothing: the renter paid from `since` to
the stop for a VM that was already gone. Now what that run was billed after `since` is given back: reversed in the
ledger (wallet credited, provider's earnings and platform fee debited in the charge's proportions), once, with an
event for the renter. Real services on PostgreSQL; only the moment of the renter's action is chosen here."""
from datetime import timedelta

import pytest

from billing.models import (
    AccountKind,
    BillingEvent,
    Entry,
    EventKind,
    LedgerTransaction,
    TransactionKind,
    UsageInterval,
)
from billing.services.ledger import earnings_balance, platform_account
from billing.services.metering import cost_for, fee_for, usage_meter
from marketplace.models import Gpu, Instance, InstanceStatus, Interruption, Node
from marketplace.money import micros_to_usd
from marketplace.services import instances as svc
from provisioning import models as provisioning_models
from provisioning.services import fleet_record, reconcile
from provisioning.services.fleet_record import node_record_health, nodes_record_health
from provisioning.services.nodes import HealthResult, running_vm_ids_by_node
from tests.billing.helpers import balance, fund, node, running, stop
from tests.factories import UserFactory
from tests.provisioning.test_reconcile_instances import FakeNode

pytestmark = pytest.mark.django_db

PRICE = 3_000_000  # $/h of the 2-GPU instance, in micro-dollars
FUNDS = 50_000_000
BPS = 1500  # PLATFORM_FEE_PERCENT = 15 (tests/billing/conftest.py)
SEEN_S = 60  # whole seconds of its run up to `since` (the VM's last sighting is 0.4 s after that)
ACTED_S = 8  # the renter's action: this long after the probe began
TOTAL_S = SEEN_S + 61 + ACTED_S  # its run up to the action: the check at `since` was recorded 1 s after its probe,
# the next one probed 60 s after that
# What the renter pays in the end (billed up to `since`, as the interruption would have) and what was given back
# (its charge up to the action, 129 whole seconds, less that).
KEPT = cost_for(PRICE, SEEN_S)  # 50_000
BACK = cost_for(PRICE, TOTAL_S) - KEPT  # 107_500 - 50_000 = 57_500
FEE_BACK = fee_for(KEPT + BACK, BPS) - fee_for(KEPT, BPS)  # 16_125 - 7_500 = 8_625


@pytest.fixture
def rented(clock):
    """A running 2-GPU instance and a 1-GPU one beside it (another renter's), seen by a health check 60.4 s after
    they started (off the whole second: `since`), and a minute later."""
    host = node(price="1.500000", gpu_count=4)
    for gpu in host.gpus.all():
        Gpu.objects.filter(pk=gpu.pk).update(uuid=f"GPU-{host.pk}-{gpu.index}")
    node_record_health(node_id=host.pk, ok=True)
    renter, neighbour = UserFactory(), UserFactory()
    fund(renter, "50")
    fund(neighbour, "50")
    lost = running(renter, host, num_gpus=2)
    kept = running(neighbour, host, num_gpus=1)
    clock.advance(SEEN_S + 0.4)
    _check(host, lost, kept, clock, "none")
    since = Node.objects.get(pk=host.pk).last_seen_at
    assert since == Instance.objects.get(pk=lost.pk).started_at + timedelta(seconds=SEEN_S + 0.4)
    clock.advance(60)  # the VM goes somewhere in here
    return renter, Node.objects.get(pk=host.pk), lost, kept, since


def _uuids(host, *, without=None):
    held = set(Gpu.objects.filter(allocations__instance=without, allocations__released_at__isnull=True)
               .values_list("uuid", flat=True)) if without else set()
    return [u for u in Gpu.objects.filter(node=host).order_by("index").values_list("uuid", flat=True) if u not in held]


def _result(host, lost, kept, clock, loss, *, probed=None):
    vms = {kept.vm_id: "running", lost.vm_id: "running"}
    if loss == "gone":
        del vms[lost.vm_id]
    elif loss == "stopped":
        vms[lost.vm_id] = "stopped"
    uuids = _uuids(host, without=lost if loss == "gpu" else None)
    return HealthResult(host.pk, True, vms=vms, probed_at=probed or clock.now, seconds=0.5, gpu_uuids=uuids)


def _check(host, lost, kept, clock, loss, *, running_vms=None):
    """One health check of `host`, probed now, recorded a second later (the instances running since before the
    probe read then, as the fleet does, unless given)."""
    result = _result(host, lost, kept, clock, loss)
    clock.advance(1)
    if running_vms is None:
        running_vms = running_vm_ids_by_node(node_ids=[host.pk], probed_before=result.probed_at)
    nodes_record_health([result], running_vm_ids=running_vms)
    return result


def _after_the_answer(monkeypatch, action):
    """Run `action` once when the check has recorded the node's answer and is about to interrupt its instances."""
    real = fleet_record._interrupt
    done = []

    def interrupt(*args, **kwargs):
        if not done:
            done.append(action())
        return real(*args, **kwargs)

    monkeypatch.setattr(fleet_record, "_interrupt", interrupt)
    return done


def _renter_does(verb, instance, clock):
    def act():
        clock.advance(ACTED_S - 1)  # the probe began 1 s before the answer was recorded
        return getattr(svc, f"instance_{verb}")(instance=Instance.objects.get(pk=instance.pk))
    return act


def _given_back(instance) -> list[LedgerTransaction]:
    charges = UsageInterval.objects.filter(instance=instance).values_list("transaction_id", flat=True)
    return list(LedgerTransaction.objects.filter(reverses_id__in=charges))


def _entries(txn) -> dict[str, int]:
    return {e.account.kind: e.amount_micros for e in txn.entries.select_related("account")}


def _earned(instance) -> int:
    """What the provider earned for an instance's usage, net of what was given back."""
    charges = list(UsageInterval.objects.filter(instance=instance).values_list("transaction_id", flat=True))
    txns = LedgerTransaction.objects.filter(pk__in=charges) | LedgerTransaction.objects.filter(
        reverses_id__in=charges)
    # _entries of each transaction, read in one query (Entry's ordering: by transaction, then id).
    by_txn: dict[int, dict[str, int]] = {}
    for txn_id, kind, amount in Entry.objects.filter(transaction__in=txns).values_list(
            "transaction_id", "account__kind", "amount_micros"):
        by_txn.setdefault(txn_id, {})[kind] = amount
    return sum(entries.get(AccountKind.PROVIDER_EARNINGS, 0) for entries in by_txn.values())


def _assert_net_charge_ends_at_since(renter, host, lost, kept):
    assert balance(renter) == FUNDS - KEPT, f"charged {FUNDS - balance(renter)}, {KEPT} up to the last sighting"
    [reversal] = _given_back(lost)
    assert reversal.kind == TransactionKind.REVERSAL
    assert _entries(reversal) == {AccountKind.CUSTOMER_WALLET: BACK, AccountKind.PROVIDER_EARNINGS: -(BACK - FEE_BACK),
                                  AccountKind.PLATFORM_REVENUE: -FEE_BACK}
    # The provider keeps what a close at `since` would have earned, the platform its fee on it.
    assert _earned(lost) == KEPT - fee_for(KEPT, BPS)
    assert earnings_balance(user_id=host.provider_id) == _earned(lost) + _earned(kept)
    fees = sum(UsageInterval.objects.filter(instance__node=host).values_list("fee_micros", flat=True))
    assert platform_account(kind=AccountKind.PLATFORM_REVENUE).balance_micros == fees - FEE_BACK
    [event] = BillingEvent.objects.filter(user=renter, kind=EventKind.CREDIT, data__instance=lost.pk)
    assert event.data["amount"] == str(micros_to_usd(BACK)) and event.data["seconds"] == TOTAL_S - SEEN_S, \
        event.message
    # Not interrupted (it was not running any more), and the instance beside it untouched.
    assert not Interruption.objects.filter(instance__node=host).exists()
    assert Instance.objects.get(pk=kept.pk).status == InstanceStatus.RUNNING
    assert not _given_back(kept) and not BillingEvent.objects.filter(kind=EventKind.CREDIT,
                                                                     data__instance=kept.pk).exists()


@pytest.mark.parametrize("ticked", [False, True], ids=["one-charge-across-since", "ticked-up-to-since"])
@pytest.mark.parametrize("verb", ["stop", "destroy", "restart"])
@pytest.mark.parametrize("loss", ["gone", "stopped", "gpu"])
def test_an_action_between_the_answer_and_the_interruption_is_billed_only_to_the_last_sighting(
        rented, clock, monkeypatch, loss, verb, ticked):
    renter, host, lost, kept, since = rented
    if ticked:
        usage_meter()  # billed up to the whole second before `since`: the action's charge is all after it
    acted = _after_the_answer(monkeypatch, _renter_does(verb, lost, clock))
    result = _check(host, lost, kept, clock, loss)
    assert acted and Instance.objects.get(pk=lost.pk).status != InstanceStatus.RUNNING
    # Billed up to the action by the action (before, kept): given back down to `since`.
    assert Instance.objects.get(pk=lost.pk).billed_seconds == TOTAL_S
    _assert_net_charge_ends_at_since(renter, host, lost, kept)

    # The same answer recorded again (a retried check), and the next check: nothing more.
    monkeypatch.undo()
    nodes_record_health([result], running_vm_ids={host.pk: {lost.vm_id, kept.vm_id}})
    clock.advance(60)
    _check(host, lost, kept, clock, loss)
    usage_meter()
    _assert_net_charge_ends_at_since(renter, host, lost, kept)


def test_a_stop_after_the_probe_before_the_check_read_what_runs_is_given_back_too(rented, clock):
    """The fleet reads the instances running since before the probe once the probes are done: one stopped in
    between is not among them, and its lost VM was not even judged."""
    renter, host, lost, kept, since = rented
    result = _result(host, lost, kept, clock, "gone")
    clock.advance(ACTED_S)
    svc.instance_stop(instance=lost)
    nodes_record_health([result], running_vm_ids=running_vm_ids_by_node(node_ids=[host.pk],
                                                                        probed_before=result.probed_at))
    _assert_net_charge_ends_at_since(renter, host, lost, kept)


@pytest.mark.parametrize("loss", ["gone", "stopped"])
def test_a_vm_the_renters_own_stop_took_down_is_not_given_back(rented, clock, loss):
    """Stopped before the probe began (its stop's job stopped or removed the VM), or its stop's job at work while
    the node answered: the answer shows what the renter asked for, not a loss. Billed up to the stop, as before."""
    renter, host, lost, kept, since = rented
    stop(lost)  # asked, and done by the worker, before the probe
    clock.advance(5)
    _check(host, lost, kept, clock, loss)
    assert not _given_back(lost) and balance(renter) == FUNDS - cost_for(PRICE, SEEN_S + 61)

    other = running(renter, host, num_gpus=2)
    clock.advance(120)
    _check(host, other, kept, clock, "none")
    clock.advance(60)
    result = _result(host, other, kept, clock, loss)
    clock.advance(ACTED_S)
    svc.instance_stop(instance=other)  # after the probe began: its job ran before the answer came
    provisioning_models.Job.objects.filter(instance=other, kind=provisioning_models.JobKind.INSTANCE_STOP).update(
        started_at=result.probed_at + timedelta(seconds=0.2))
    nodes_record_health([result], running_vm_ids={host.pk: {kept.vm_id}})
    assert not _given_back(other)


def test_an_instance_the_probe_found_running_is_untouched(rented, clock):
    """Its renter stopped it just after a check whose answer showed its VM running: billed up to the stop."""
    renter, host, lost, kept, since = rented
    result = _result(host, lost, kept, clock, "none")
    clock.advance(ACTED_S)
    svc.instance_stop(instance=lost)
    nodes_record_health([result], running_vm_ids={host.pk: {kept.vm_id}})
    assert not _given_back(lost) and balance(renter) == FUNDS - cost_for(PRICE, TOTAL_S)
    assert not BillingEvent.objects.filter(user=renter, kind=EventKind.CREDIT, data__instance=lost.pk).exists()


@pytest.mark.parametrize("when", ["before-the-pass-read-it", "before-it-was-interrupted"])
def test_the_reconcilers_vm_lost_path_gives_it_back_the_same_way(rented, clock, monkeypatch, when):
    renter, host, lost, kept, since = rented
    fake = FakeNode()
    fake.vms = {kept.vm_id: "running"}  # the lost instance's VM is gone
    monkeypatch.setattr("provisioning.services.reconcile.node_session", fake.session)
    act = _renter_does("stop", lost, clock)
    if when == "before-the-pass-read-it":
        fake.on_list.append(lambda: (clock.advance(1), act()))
    else:
        judge = reconcile._running_vm_lost

        def stopped_first(*args, **kwargs):
            clock.advance(1)
            act()
            return judge(*args, **kwargs)

        monkeypatch.setattr(reconcile, "_running_vm_lost", stopped_first)
    reconcile.node_reconcile(host)
    assert Instance.objects.get(pk=lost.pk).status == InstanceStatus.STOPPING
    _assert_net_charge_ends_at_since(renter, host, lost, kept)
    reconcile.node_reconcile(host)  # the next pass: nothing more
    _assert_net_charge_ends_at_since(renter, host, lost, kept)
