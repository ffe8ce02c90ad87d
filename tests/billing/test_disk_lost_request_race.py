"""A stopped instance's disk billed up to a request that came between a look that found its VM and disk gone and the
check that fails it.

The health check's probe (or the reconciler's list) finds the stopped instance's VM and disk gone, last seen at the
node's previous answer (`since`); the check fails such an instance with its disk billed up to `since`
(fleet_record._stopped_vms_lost_fail, reconcile._judge_stopped: instance_mark_failed's `disk_seen_at`). But the
renter's start or destroy came between the probe and that step: it closed the disk's billing at its own moment (the
node answering, storage_billed_until is `now`), and the check, finding the instance no longer stopped, left it. The
renter paid for the disk from `since` up to the request (here 67 s of 500 GB), time the platform treats as lost:
nothing gave it back. interruptions.lost_disk_give_back (billing.services.storage.disk_give_back) now ends the
disk's charge at `since`, as the failure would have and as a running instance's GPU time does in the same race
(lost_usage_give_back), to the micro-dollar, once. Real services on PostgreSQL; only the moment of the renter's
request is chosen here."""
import pytest

from billing.models import AccountKind, BillingEvent, EventKind, LedgerTransaction, TransactionKind
from billing.selectors import instance_cost
from billing.services.ledger import earnings_balance, platform_account
from billing.services.storage import storage_cost, storage_meter
from marketplace.models import Instance, InstanceStatus
from marketplace.money import micros_to_usd
from marketplace.services import instances as svc
from marketplace.services.instances.interruptions import lost_disk_give_back
from provisioning.services.fleet_record import node_record_health
from tests.billing.helpers import balance, fund, node, running, stop
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

PRICE = 300_000  # µ$ per GB-month
SIZE_GB = 500
BPS = 1500  # PLATFORM_FEE_PERCENT = 15 (tests/billing/conftest.py)
SEEN_S = 300  # whole seconds of the stop up to its last sighting (0.4 s before it)
ACTED_S = 67  # the renter's request: this long after the stop's last whole second before the sighting
DETAIL = "the server answers, but the VM is no longer on it"


def _cost(seconds: int) -> int:
    return storage_cost(size_gb=SIZE_GB, price_per_gb_month_micros=PRICE, seconds=seconds)


def _fee(cost: int) -> int:
    return cost * BPS // 10_000


def _stopped(clock):
    renter = UserFactory()
    fund(renter, "20")
    host = node("1.000000")
    host.disk_price_per_gb_month_micros = PRICE
    host.save()
    instance = running(renter, host)
    Instance.objects.filter(pk=instance.pk).update(disk_gb=SIZE_GB)
    clock.advance(60)
    instance = stop(instance)
    assert instance.stopped_at == clock.now
    return renter, host, instance


def _disk_paid(renter, instance) -> int:
    """What the renter's wallet paid for the instance's disk, net of what came back (the ledger's word)."""
    prefix = f"storage:disk:{instance.pk}:"
    charges = list(LedgerTransaction.objects.filter(kind=TransactionKind.STORAGE, idempotency_key__startswith=prefix))
    txns = charges + list(LedgerTransaction.objects.filter(reverses__in=charges))
    return -sum(e.amount_micros for t in txns for e in t.entries.select_related("account")
                if e.account.kind == AccountKind.CUSTOMER_WALLET and e.account.user_id == renter.pk)


def _race(clock, renter, host, instance, verb: str, *, ticked: bool):
    """A check lists the stopped VM (its last sighting, 300.4 s after the stop); the next probe finds it gone; the
    renter's `verb` comes 7 s into that probe, before the check is recorded. Returns (sighting, probe's start)."""
    clock.advance(SEEN_S + 0.4)
    node_record_health(node_id=host.pk, ok=True, vms={instance.vm_id: "stopped"}, probed_at=clock.now)
    sighting = clock.now
    if ticked:
        storage_meter()  # billed up to the whole second before the sighting: the request's charge is all after it
    clock.advance(60)
    probed = clock.now
    clock.advance(ACTED_S - 60 - 0.4)
    getattr(svc, f"instance_{verb}")(instance=Instance.objects.get(pk=instance.pk))
    clock.advance(1)
    node_record_health(node_id=host.pk, ok=True, vms={}, probed_at=probed)
    left = Instance.objects.get(pk=instance.pk)
    assert left.status != InstanceStatus.STOPPED and left.status != InstanceStatus.FAILED  # not the check's to fail
    # Billed up to the request: 67 s of a disk the check found gone.
    assert left.disk_billed_seconds == SEEN_S + ACTED_S and left.disk_cost_micros == _cost(SEEN_S + ACTED_S)
    return sighting, probed


@pytest.mark.parametrize("ticked", [False, True], ids=["one-charge-across-the-sighting", "ticked-up-to-it"])
@pytest.mark.parametrize("verb", ["destroy", "start"])
def test_a_request_between_the_probe_and_the_failing_check_is_billed_only_to_the_last_sighting(clock, verb, ticked):
    renter, host, instance = _stopped(clock)
    sighting, probed = _race(clock, renter, host, instance, verb, ticked=ticked)
    wallet, earned = balance(renter), earnings_balance(user_id=host.provider_id)
    revenue = platform_account(kind=AccountKind.PLATFORM_REVENUE).balance_micros

    # What the fleet is to do for such an instance once its check is recorded (0 here once the fleet does it itself:
    # test_the_health_check_itself_gives_it_back).
    back = lost_disk_give_back(instance_id=instance.pk, since=sighting, looked_at=probed, detail=DETAIL)

    kept, charged = _cost(SEEN_S), _cost(SEEN_S + ACTED_S)
    fee_back = _fee(charged) - _fee(kept)
    assert back in (charged - kept, 0) and charged - kept > 0
    assert _disk_paid(renter, instance) == kept  # was `charged`: 67 s more
    if back:
        assert balance(renter) - wallet == back
        assert earned - earnings_balance(user_id=host.provider_id) == back - fee_back
        assert revenue - platform_account(kind=AccountKind.PLATFORM_REVENUE).balance_micros == fee_back
    reversals = LedgerTransaction.objects.filter(kind=TransactionKind.REVERSAL, reverses__kind=TransactionKind.STORAGE,
                                                 reverses__idempotency_key__startswith=f"storage:disk:{instance.pk}:")
    assert reversals.count() == 1
    # What the renter is shown (the instance page's figure, net of what came back): what the ledger says.
    shown = Instance.objects.get(pk=instance.pk)
    assert instance_cost(instance=shown)["disk_amount_micros"] == kept
    assert shown.disk_cost_micros == charged  # the row's own total: as charged (the meter's arithmetic reads it)
    [reversal] = reversals
    moved = {e.account.kind: e.amount_micros for e in reversal.entries.select_related("account")}
    assert moved == {AccountKind.CUSTOMER_WALLET: charged - kept,
                     AccountKind.PROVIDER_EARNINGS: -(charged - kept - fee_back),
                     AccountKind.PLATFORM_REVENUE: -fee_back}
    [event] = BillingEvent.objects.filter(user=renter, kind=EventKind.CREDIT, data__instance=instance.pk)
    assert event.data["disk"] is True and event.data["seconds"] == ACTED_S
    assert event.data["amount"] == str(micros_to_usd(charged - kept)), event.message

    # Once: the same look, or a later one, gives nothing more.
    assert lost_disk_give_back(instance_id=instance.pk, since=sighting, looked_at=probed, detail=DETAIL) == 0
    clock.advance(60)
    assert lost_disk_give_back(instance_id=instance.pk, since=sighting, looked_at=clock.now, detail=DETAIL) == 0
    assert reversals.count() == 1 and _disk_paid(renter, instance) == kept
    assert BillingEvent.objects.filter(user=renter, kind=EventKind.CREDIT, data__instance=instance.pk).count() == 1


def test_a_request_before_the_probe_is_billed_up_to_it(clock):
    """Destroyed before the look began: its disk was billed up to the destroy while it was there; nothing back."""
    renter, host, instance = _stopped(clock)
    clock.advance(SEEN_S + 0.4)
    node_record_health(node_id=host.pk, ok=True, vms={instance.vm_id: "stopped"}, probed_at=clock.now)
    sighting = clock.now
    clock.advance(30)
    svc.instance_destroy(instance=Instance.objects.get(pk=instance.pk))
    clock.advance(30)
    probed = clock.now
    node_record_health(node_id=host.pk, ok=True, vms={}, probed_at=probed)
    assert lost_disk_give_back(instance_id=instance.pk, since=sighting, looked_at=probed, detail=DETAIL) == 0
    assert _disk_paid(renter, instance) == _cost(SEEN_S + 30)
    assert not BillingEvent.objects.filter(user=renter, kind=EventKind.CREDIT, data__instance=instance.pk).exists()


def test_one_still_stopped_is_the_checks_to_fail(clock):
    """Still stopped when the check comes: it fails it, its disk billed up to the sighting; nothing to give back."""
    renter, host, instance = _stopped(clock)
    clock.advance(SEEN_S + 0.4)
    node_record_health(node_id=host.pk, ok=True, vms={instance.vm_id: "stopped"}, probed_at=clock.now)
    sighting = clock.now
    clock.advance(60)
    probed = clock.now
    node_record_health(node_id=host.pk, ok=True, vms={}, probed_at=probed)
    assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.FAILED
    assert lost_disk_give_back(instance_id=instance.pk, since=sighting, looked_at=probed, detail=DETAIL) == 0
    assert _disk_paid(renter, instance) == _cost(SEEN_S)


def test_the_health_check_itself_gives_it_back(clock):
    """The check that found the disk gone gives the disk's time after its last sighting back by itself."""
    renter, host, instance = _stopped(clock)
    _race(clock, renter, host, instance, "destroy", ticked=False)
    assert _disk_paid(renter, instance) == _cost(SEEN_S)
