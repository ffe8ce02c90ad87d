"""A price raised on a running instance gives the renter the low-balance warning and its notice, never a stop at
once. Found by review: a renter whose instance ran at $0/h (its node rejected) burned nothing, so a balance at or
near zero was never warned about; the check that raised the price back left the next meter tick to stop the
instance at once, with no warning and no grace. Now the raise re-reads the balance against the new burn rate and,
when it is low, warns then and keeps the renter running until BILLING_LOW_BALANCE_WARNING_S after the raise."""
from datetime import timedelta
from decimal import Decimal

import pytest
from django.core import mail

from billing.models import BillingEvent, BillingProfile, EventKind
from billing.services.ledger import credit_grant, ledger_reverse
from billing.tasks import usage_meter_tick
from marketplace.models import Gpu, Instance
from marketplace.money import usd_to_micros
from marketplace.services import instances as svc
from provisioning.models import Job, JobKind
from provisioning.services.fleet_record import node_record_health
from tests.billing.helpers import balance, node, run, running, stop
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def tick(django_capture_on_commit_callbacks):
    """A health check that finds the node well, then one meter tick (its e-mails sent on commit)."""
    def run_tick(host):
        node_record_health(node_id=host.pk, ok=True)
        with django_capture_on_commit_callbacks(execute=True):
            usage_meter_tick()
    return run_tick


@pytest.fixture
def recheck(django_capture_on_commit_callbacks):
    """A re-verification of the node with this verdict and score (its e-mails sent on commit)."""
    from provisioning.services.verification import node_verify_conclude

    def run_check(host, verdict, score, gpu_index):
        job = Job.objects.create(kind=JobKind.NODE_VERIFY, node=host, status="running",
                                 deadline=host.created_at + timedelta(days=1))
        severity = "reject" if verdict == "rejected" else "degrade"
        with django_capture_on_commit_callbacks(execute=True):
            node_verify_conclude(job=job, verdict=verdict, score=score, inventory={},
                                 findings=[{"severity": severity, "code": "gpu_name", "message": "gpu_name measured",
                                            "gpu_index": gpu_index}])
    return run_check


def _credit(user, usd: str):
    txn, _ = credit_grant(user=user, amount_micros=usd_to_micros(Decimal(usd)), reason="test funds")
    return txn


def _free_then_drained(recheck, clock, *, keep: str | None):
    """A renter's $3/h instance, rejected at once ($0/h); an hour later an operator reverses the credit it was
    booked with, leaving `keep` (or nothing). Nothing burns, so nothing warns."""
    renter = UserFactory()
    booked_with = _credit(renter, "3.00")
    host = node(price="1.500000", gpu_count=4)
    node_record_health(node_id=host.pk, ok=True)
    instance = running(renter, host, num_gpus=2)
    card = Gpu.objects.filter(allocations__instance=instance).order_by("index").first()
    recheck(host, "rejected", None, gpu_index=card.index)
    assert Instance.objects.get(pk=instance.pk).price_per_hour_micros == 0
    clock.advance(3600)
    if keep is not None:
        _credit(renter, keep)
    ledger_reverse(txn=booked_with, reason="credited by mistake")
    return renter, host, instance


def _kinds(user) -> list[str]:
    return list(BillingEvent.objects.filter(user=user).order_by("pk").values_list("kind", flat=True))


def _status(instance) -> str:
    return Instance.objects.get(pk=instance.pk).status


@pytest.mark.parametrize("keep", [None, "0.50"], ids=["balance-zero", "ten-minutes-left"])
def test_a_raise_back_warns_a_low_balance_and_stops_only_after_the_warnings_notice(
        recheck, tick, clock, settings, keep):
    settings.BILLING_LOW_BALANCE_WARNING_S = 3600
    renter, host, instance = _free_then_drained(recheck, clock, keep=keep)
    tick(host)
    assert _status(instance) == "running" and "low_balance" not in _kinds(renter)  # at $0/h nothing burns
    mail.outbox.clear()
    raised_at = clock.now
    recheck(host, "verified", 1.0, gpu_index=None)
    assert Instance.objects.get(pk=instance.pk).price_per_hour_micros == 3_000_000
    # Warned at the raise, by the ordinary warning and in the raise's own message.
    [warning] = BillingEvent.objects.filter(user=renter, kind=EventKind.LOW_BALANCE)
    assert warning.data["seconds_left"] == (600 if keep else 0) and warning.data["per_hour"] == "3.000000"
    assert warning.data["stop_not_before"] == (raised_at + timedelta(seconds=3600)).isoformat()
    raised = BillingEvent.objects.get(user=renter, kind=EventKind.PRICE_RAISED_BACK)
    stop_at = raised_at + timedelta(seconds=3600)
    assert f"{stop_at:%Y-%m-%d %H:%M}" in raised.message and "top up" in raised.message
    assert raised.data["stop_not_before"] == stop_at.isoformat()
    assert BillingProfile.objects.get(user=renter).stop_not_before == stop_at
    subjects = [m.subject for m in mail.outbox]
    assert any("running low" in s for s in subjects) and any("went back up" in s for s in subjects)
    # It keeps running through the notice, although the balance reaches zero and below (owed).
    for _ in range(11):
        clock.advance(5 * 60)
        tick(host)
        assert _status(instance) == "running"
    assert balance(renter) < 0
    assert _kinds(renter).count("low_balance") == 1 and "balance_depleted" not in _kinds(renter)
    # Stopped at the first tick after it, as at zero in the ordinary way (a stop job; the disk is kept).
    clock.advance(5 * 60)
    tick(host)
    assert _status(instance) == "stopping" and "balance_depleted" in _kinds(renter)
    assert clock.now >= stop_at


def test_a_raise_back_with_plenty_of_balance_warns_nobody(recheck, tick, clock):
    renter = UserFactory()
    _credit(renter, "50")
    host = node(price="1.500000", gpu_count=4)
    node_record_health(node_id=host.pk, ok=True)
    instance = running(renter, host, num_gpus=2)
    card = Gpu.objects.filter(allocations__instance=instance).order_by("index").first()
    recheck(host, "rejected", None, gpu_index=card.index)
    clock.advance(3600)
    recheck(host, "verified", 1.0, gpu_index=None)
    raised = BillingEvent.objects.get(user=renter, kind=EventKind.PRICE_RAISED_BACK)
    assert "balance" not in raised.message and "stop_not_before" not in raised.data
    assert "low_balance" not in _kinds(renter)
    assert BillingProfile.objects.filter(user=renter, stop_not_before__isnull=False).count() == 0
    tick(host)
    assert _status(instance) == "running" and "low_balance" not in _kinds(renter)


def test_an_instance_started_at_its_cut_price_and_raised_while_starting_gets_the_notice_too(
        recheck, tick, clock, settings):
    """A stopped instance cut to $0/h starts with no funds (an hour of $0 is $0); raised before it runs, it is
    billed at the new price once running: the same warning and notice."""
    settings.BILLING_LOW_BALANCE_WARNING_S = 3600
    renter, host, instance = _free_then_drained(recheck, clock, keep=None)
    stop(instance)
    assert balance(renter) <= 0
    svc.instance_start(instance=instance)  # the funds check at $0/h
    recheck(host, "verified", 1.0, gpu_index=None)
    assert "low_balance" in _kinds(renter)
    stop_at = BillingProfile.objects.get(user=renter).stop_not_before
    assert stop_at == clock.now + timedelta(seconds=3600)
    run(instance)
    clock.advance(30 * 60)
    tick(host)
    assert _status(instance) == "running"
    clock.advance(31 * 60)
    tick(host)
    assert _status(instance) == "stopping"
