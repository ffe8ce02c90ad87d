"""A look that finds a card missing (a verification's inventory, or a health check) stopped by Celery's soft time
limit in its interruptions, before it gave back what a renter's stop (or destroy) after the look billed past the
card's last sighting. gpu_presence.node_gpus_presence gave back in the loop with the interruptions, in instance id
order: a limit landing in an earlier holder's interruption (its notices, its credit) ended the verification with
nothing given back, and no later look can give it (it begins after the stop, which then explains the card's state;
usage_give_back refuses a run closed before the look). The health check passed no look time at all, so a holder
stopped after its first give-back (fleet_record._usage_after_loss_given_back) waited for the last step of the batch.

Now the give-back comes right after the look, before any interruption, and again in the transaction of a holder's
interruption that finds it no longer running; once, by the reversal's ledger key (`reversal:<charge id>`). Real
services on PostgreSQL; only the moments of the renter's verb and of the limit are chosen here."""
from datetime import timedelta

import pytest
from celery.exceptions import SoftTimeLimitExceeded

from billing.models import BillingEvent, EventKind, LedgerTransaction, UsageInterval
from billing.services.ledger import earnings_balance
from billing.services.metering import cost_for, fee_for
from marketplace.models import Gpu, Instance, InstanceStatus, Node
from marketplace.services import instances as svc
from provisioning.services import fleet_record
from provisioning.services.fleet_record import nodes_record_health
from provisioning.services.nodes import HealthResult, node_apply_inventory, running_vm_ids_by_node
from tests.billing.helpers import balance, fund, node, running
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

_SECOND = timedelta(seconds=1)
PRICE = 3_000_000  # $/h of the renter's 2-GPU instance, in micro-dollars
OTHER_PRICE = 1_500_000  # of the other holder's 1-GPU instance
FUNDS = 50_000_000
BPS = 1500  # PLATFORM_FEE_PERCENT = 15 (tests/billing/conftest.py)
SEEN_S = 60  # whole seconds of the runs up to the last health check (0.4 s after that, off the whole second)
KEPT = cost_for(PRICE, SEEN_S)  # 50_000: what the renter pays in the end
OTHER_KEPT = cost_for(OTHER_PRICE, SEEN_S)  # 25_000: the other holder's, interrupted at the sighting
CHARGED = cost_for(PRICE, SEEN_S + 60 + 8)  # 106_666: the look (or probe) 60 s on, the renter's stop 8 s after it


@pytest.fixture
def rented(request, clock):
    """The renter's running 2-GPU instance and another renter's 1-GPU one on the same node, booked in the order
    the parameter says (the interruptions go in id order), seen by a health check 60.4 s after they started
    (cards and VMs listed); a minute on, a look finds all three of their cards gone."""
    host = node(price="1.500000", gpu_count=4)
    for gpu in host.gpus.all():
        Gpu.objects.filter(pk=gpu.pk).update(uuid=f"GPU-{host.pk}-{gpu.index}")
    renter, other = UserFactory(), UserFactory()
    fund(renter, "50")
    fund(other, "50")
    if request.param == "other-first":  # the judging order the test needs
        held = running(other, host, num_gpus=1)
        lost = running(renter, host, num_gpus=2)
        assert held.pk < lost.pk
    else:
        lost = running(renter, host, num_gpus=2)
        held = running(other, host, num_gpus=1)
    clock.advance(SEEN_S + 0.4)
    _check(host, lost, held, clock)
    assert Node.objects.get(pk=host.pk).last_seen_at == clock.now - _SECOND
    cards = set(Gpu.objects.filter(allocations__instance__in=[lost, held]).values_list("uuid", flat=True))
    assert len(cards) == 3
    clock.advance(60 - 1)
    return renter, other, Node.objects.get(pk=host.pk), lost, held, cards


def _result(host, lost, held, clock, *, without=()):
    uuids = [u for u in Gpu.objects.filter(node=host).order_by("index").values_list("uuid", flat=True)
             if u not in without]
    return HealthResult(host.pk, True, vms={lost.vm_id: "running", held.vm_id: "running"}, probed_at=clock.now,
                        seconds=0.5, gpu_uuids=uuids)


def _check(host, lost, held, clock, *, without=()):
    """A health check probed now and recorded a second later, the running VMs read as the fleet does."""
    result = _result(host, lost, held, clock, without=without)
    clock.advance(1)
    return nodes_record_health([result], running_vm_ids=running_vm_ids_by_node(node_ids=[host.pk],
                                                                               probed_before=result.probed_at))


def _inventory(host, without):
    return {"gpus": [{"index": i, "uuid": u, "name": "NVIDIA RTX A6000"} for i, u in
                     Gpu.objects.filter(node=host).order_by("index").values_list("index", "uuid") if u not in without]}


def _given_back(instance) -> list[LedgerTransaction]:
    charges = UsageInterval.objects.filter(instance=instance).values_list("transaction_id", flat=True)
    return list(LedgerTransaction.objects.filter(reverses_id__in=charges))


def _limit_in_interruption_of(monkeypatch, instance, before=None):
    """Celery's soft limit lands in `instance`'s interruption; `before(instance_id)` runs as any other's begins."""
    real = svc.instance_interrupt

    def interrupt(*, instance_id, **kwargs):
        if instance_id == instance.pk:
            raise SoftTimeLimitExceeded()
        if before is not None:
            before(instance_id)
        return real(instance_id=instance_id, **kwargs)

    monkeypatch.setattr(svc, "instance_interrupt", interrupt)
    return real


def _renter_paid_to_the_sighting_once(renter, host, lost, credits) -> None:
    assert balance(renter) == FUNDS - KEPT, f"charged {FUNDS - balance(renter)}, {KEPT} up to the last sighting"
    (reversal,) = _given_back(lost)
    assert reversal.idempotency_key == f"reversal:{reversal.reverses_id}"
    assert BillingEvent.objects.filter(user=renter, kind=EventKind.CREDIT).count() == credits + 1


def _interrupted_at_the_sighting(instance) -> None:
    """Billed up to the card's last sighting, by its interruption (credited on top, at the provider's expense)."""
    assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.INTERRUPTED
    interval = UsageInterval.objects.get(instance=instance)
    assert (interval.seconds, interval.amount_micros) == (SEEN_S, OTHER_KEPT)


def _credits(user) -> int:
    return BillingEvent.objects.filter(user=user, kind=EventKind.CREDIT).count()  # its funds' grant so far


@pytest.mark.parametrize("rented", ["other-first"], indirect=True)
@pytest.mark.parametrize("verb", ["stop", "destroy"])
def test_the_inventorys_give_back_comes_before_a_limit_in_another_holders_interruption(
        clock, rented, monkeypatch, verb):
    """The renter's verb 8 s after the verification's look; the limit lands in the other holder's interruption.
    Before, with the other holder first in id order, nothing was given back (charged 106,666 µ, not 50,000)."""
    renter, other, host, lost, held, cards = rented
    looked_at, credits = clock.now, _credits(renter)
    clock.advance(8)
    getattr(svc, f"instance_{verb}")(instance=Instance.objects.get(pk=lost.pk))
    assert balance(renter) == FUNDS - CHARGED
    real = _limit_in_interruption_of(monkeypatch, held)
    with pytest.raises(SoftTimeLimitExceeded):
        node_apply_inventory(node=Node.objects.get(pk=host.pk), inventory=_inventory(host, cards),
                             looked_at=looked_at)
    _renter_paid_to_the_sighting_once(renter, host, lost, credits)
    assert earnings_balance(user_id=host.provider_id) == KEPT - fee_for(KEPT, BPS)  # the other: not billed yet
    assert Instance.objects.get(pk=held.pk).status == InstanceStatus.RUNNING  # the limit came first

    # The verification again (its retry, the same look or a later one) and a health check still missing the
    # cards: the other holder is interrupted at the sighting, the renter is given nothing more.
    monkeypatch.setattr(svc, "instance_interrupt", real)
    node_apply_inventory(node=Node.objects.get(pk=host.pk), inventory=_inventory(host, cards), looked_at=looked_at)
    _interrupted_at_the_sighting(held)
    clock.advance(30)
    node_apply_inventory(node=Node.objects.get(pk=host.pk), inventory=_inventory(host, cards), looked_at=clock.now)
    _check(host, lost, held, clock, without=cards)
    _renter_paid_to_the_sighting_once(renter, host, lost, credits)


@pytest.mark.parametrize("rented", ["other-first"], indirect=True)
def test_the_health_checks_card_give_back_comes_before_a_limit_in_another_holders_interruption(
        clock, rented, monkeypatch):
    """The renter's stop after the check recorded its answer (after its first give-back), 8 s after the probe; the
    limit lands in the other holder's interruption. Before, the card path gave back only as the batch's last step
    (charged 106,666 µ, not 50,000)."""
    renter, other, host, lost, held, cards = rented
    credits = _credits(renter)
    result = _result(host, lost, held, clock, without=cards)
    clock.advance(1)
    running_vms = running_vm_ids_by_node(node_ids=[host.pk], probed_before=result.probed_at)
    real_judge, stopped = fleet_record._interrupt, []

    def judge(*args, **kwargs):  # the check's VM step, after the record: the renter's stop lands here
        if not stopped:
            clock.advance(7)
            stopped.append(svc.instance_stop(instance=Instance.objects.get(pk=lost.pk)))
        return real_judge(*args, **kwargs)

    monkeypatch.setattr(fleet_record, "_interrupt", judge)
    real = _limit_in_interruption_of(monkeypatch, held)
    with pytest.raises(SoftTimeLimitExceeded):
        nodes_record_health([result], running_vm_ids=running_vms)
    assert stopped
    _renter_paid_to_the_sighting_once(renter, host, lost, credits)

    # The next check, with time to finish: the other holder interrupted at the sighting, nothing more given.
    monkeypatch.setattr(svc, "instance_interrupt", real)
    monkeypatch.setattr(fleet_record, "_interrupt", real_judge)
    clock.advance(60)
    _check(host, lost, held, clock, without=cards)
    _interrupted_at_the_sighting(held)
    _renter_paid_to_the_sighting_once(renter, host, lost, credits)


@pytest.mark.parametrize("rented", ["renter-first"], indirect=True)
@pytest.mark.parametrize("look", ["inventory", "health-check"])
def test_a_stop_racing_a_holders_own_interruption_is_given_back_in_its_transaction(
        clock, rented, monkeypatch, look):
    """The renter's stop lands just as its own interruption begins (after the look's first give-back, the card
    still held); the limit lands in the next holder's. Before, the health check left it to the batch's last step
    (charged 106,666 µ, not 50,000); the verification gave it back just after, as now, but not with the decision."""
    renter, other, host, lost, held, cards = rented
    assert lost.pk < held.pk  # the renter's instance is judged first
    credits = _credits(renter)
    looked_at = clock.now

    def stop_first(instance_id):
        if instance_id == lost.pk:
            clock.advance(8 - (1 if look == "health-check" else 0))
            svc.instance_stop(instance=Instance.objects.get(pk=lost.pk))

    real = _limit_in_interruption_of(monkeypatch, held, before=stop_first)
    with pytest.raises(SoftTimeLimitExceeded):
        if look == "inventory":
            node_apply_inventory(node=Node.objects.get(pk=host.pk), inventory=_inventory(host, cards),
                                 looked_at=looked_at)
        else:
            _check(host, lost, held, clock, without=cards)
    assert Instance.objects.get(pk=lost.pk).status != InstanceStatus.INTERRUPTED  # the renter's stop stands
    _renter_paid_to_the_sighting_once(renter, host, lost, credits)

    monkeypatch.setattr(svc, "instance_interrupt", real)
    clock.advance(60)
    _check(host, lost, held, clock, without=cards)
    _interrupted_at_the_sighting(held)
    _renter_paid_to_the_sighting_once(renter, host, lost, credits)
