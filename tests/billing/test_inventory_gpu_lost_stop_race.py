"""A verification's inventory (nodes.node_apply_inventory -> gpu_presence.node_gpus_presence) that finds a card
missing interrupts its holders at the node's last health check (the last moment the card was listed). A renter's
stop (or destroy) between the inventory's look and that interruption closed billing at its own moment (the node
answers: node_billable_until is `now`), and the interruption, finding the instance no longer running, did nothing:
the renter paid from the last sighting to the stop for a card already gone, with nothing given back. The health check
and the reconciler give that back (bb5beec, ce5a86b); now the verification's path does too, by the same rule
(interruptions.lost_usage_give_back: reversed in the ledger, wallet credited, earnings and fee debited in the
charge's proportions, once by the reversal's key)."""
import pytest

from billing.models import AccountKind, BillingEvent, EventKind, LedgerTransaction, UsageInterval
from billing.services.ledger import earnings_balance, platform_account
from billing.services.metering import cost_for, fee_for
from marketplace.models import Gpu, Instance, InstanceStatus, Node
from marketplace.services import instances as svc
from provisioning.services.fleet_record import nodes_record_health
from provisioning.services.nodes import HealthResult, node_apply_inventory
from tests.billing.helpers import balance, fund, node, running
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

PRICE = 3_000_000  # $/h of the 2-GPU instance, in micro-dollars
FUNDS = 50_000_000
BPS = 1500  # PLATFORM_FEE_PERCENT = 15 (tests/billing/conftest.py)
SEEN_S = 60  # whole seconds of its run up to the last health check (0.4 s after that, off the whole second)
LOOK_S = 60  # the verification's look begins this long after that check
ACTED_S = 8  # the renter acts this long after the look began
KEPT = cost_for(PRICE, SEEN_S)  # 50_000: what the renter pays in the end
BACK = cost_for(PRICE, SEEN_S + LOOK_S + ACTED_S) - KEPT  # 128 s charged by the stop: 106_666 - 50_000
FEE_BACK = fee_for(KEPT + BACK, BPS) - fee_for(KEPT, BPS)


@pytest.fixture
def rented(clock):
    """A running 2-GPU instance and a 1-GPU one beside it (another renter's), seen by a health check (cards and
    VMs listed) 60.4 s after they started, then a minute later the verification's look begins."""
    host = node(price="1.500000", gpu_count=4)
    for gpu in host.gpus.all():
        Gpu.objects.filter(pk=gpu.pk).update(uuid=f"GPU-{host.pk}-{gpu.index}")
    renter, neighbour = UserFactory(), UserFactory()
    fund(renter, "50")
    fund(neighbour, "50")
    lost = running(renter, host, num_gpus=2)
    kept = running(neighbour, host, num_gpus=1)
    clock.advance(SEEN_S + 0.4)
    _check(host, lost, kept, clock, without=None)
    seen = Node.objects.get(pk=host.pk).last_seen_at
    assert seen == clock.now
    cards = set(Gpu.objects.filter(allocations__instance=lost).values_list("uuid", flat=True))
    clock.advance(LOOK_S)
    return renter, neighbour, Node.objects.get(pk=host.pk), lost, kept, cards


def _check(host, lost, kept, clock, *, without):
    uuids = [u for u in Gpu.objects.filter(node=host).order_by("index").values_list("uuid", flat=True)
             if u not in (without or ())]
    vms = {lost.vm_id: "running", kept.vm_id: "running"}
    result = HealthResult(host.pk, True, vms=vms, probed_at=clock.now, seconds=0.5, gpu_uuids=uuids)
    return nodes_record_health([result], running_vm_ids={host.pk: {lost.vm_id, kept.vm_id}})


def _inventory(host, without):
    return {"gpus": [{"index": i, "uuid": u, "name": "NVIDIA RTX A6000"} for i, u in
                     Gpu.objects.filter(node=host).order_by("index").values_list("index", "uuid") if u not in without]}


def _given_back(instance) -> list[LedgerTransaction]:
    charges = UsageInterval.objects.filter(instance=instance).values_list("transaction_id", flat=True)
    return list(LedgerTransaction.objects.filter(reverses_id__in=charges))


def _platform_fee() -> int:
    return platform_account(kind=AccountKind.PLATFORM_REVENUE).balance_micros


@pytest.mark.parametrize("verb", ["stop", "destroy"])
def test_a_stop_racing_the_inventorys_interruption_is_given_back_what_came_after_the_cards_last_sighting(
        clock, rented, verb):
    renter, neighbour, host, lost, kept, cards = rented
    looked_at = clock.now
    credits = BillingEvent.objects.filter(user=renter, kind=EventKind.CREDIT).count()  # its funds' grant
    clock.advance(ACTED_S)
    getattr(svc, f"instance_{verb}")(instance=Instance.objects.get(pk=lost.pk))
    assert balance(renter) == FUNDS - KEPT - BACK  # the stop billed the run up to itself

    node_apply_inventory(node=Node.objects.get(pk=host.pk), inventory=_inventory(host, cards), looked_at=looked_at)

    assert Instance.objects.get(pk=lost.pk).status != InstanceStatus.INTERRUPTED  # the renter's verb stands
    assert balance(renter) == FUNDS - KEPT, f"charged {FUNDS - balance(renter)}, {KEPT} up to the last sighting"
    (reversal,) = _given_back(lost)
    assert reversal.idempotency_key == f"reversal:{reversal.reverses_id}"
    assert earnings_balance(user_id=host.provider_id) == KEPT - fee_for(KEPT, BPS)
    assert _platform_fee() == fee_for(KEPT, BPS) == fee_for(KEPT + BACK, BPS) - FEE_BACK
    assert BillingEvent.objects.filter(user=renter, kind=EventKind.CREDIT).count() == credits + 1
    assert balance(neighbour) == FUNDS and Instance.objects.get(pk=kept.pk).status == InstanceStatus.RUNNING

    # Exactly once: the verification again, and health checks that still miss the card, give nothing more.
    node_apply_inventory(node=Node.objects.get(pk=host.pk), inventory=_inventory(host, cards), looked_at=looked_at)
    clock.advance(30)
    _check(host, lost, kept, clock, without=cards)
    node_apply_inventory(node=Node.objects.get(pk=host.pk), inventory=_inventory(host, cards), looked_at=clock.now)
    assert balance(renter) == FUNDS - KEPT and len(_given_back(lost)) == 1
    assert BillingEvent.objects.filter(user=renter, kind=EventKind.CREDIT).count() == credits + 1


def test_a_stop_before_the_look_is_not_given_back(clock, rented):
    """Stopped before the inventory was asked for: the stop may be why the card was let go; its billing up to the
    stop stands, as the health check's rule has it."""
    renter, _, host, lost, _, cards = rented
    svc.instance_stop(instance=Instance.objects.get(pk=lost.pk))
    clock.advance(ACTED_S)
    node_apply_inventory(node=Node.objects.get(pk=host.pk), inventory=_inventory(host, cards), looked_at=clock.now)
    assert balance(renter) == FUNDS - cost_for(PRICE, SEEN_S + LOOK_S) and _given_back(lost) == []


def test_a_holder_still_running_is_interrupted_at_the_last_sighting_as_before(clock, rented):
    renter, _, host, lost, _, cards = rented
    looked_at = clock.now
    clock.advance(ACTED_S)
    node_apply_inventory(node=Node.objects.get(pk=host.pk), inventory=_inventory(host, cards), looked_at=looked_at)
    assert Instance.objects.get(pk=lost.pk).status == InstanceStatus.INTERRUPTED
    interval = UsageInterval.objects.get(instance=lost)  # billed up to the last sighting by the interruption
    assert (interval.seconds, interval.amount_micros) == (SEEN_S, KEPT) and _given_back(lost) == []
