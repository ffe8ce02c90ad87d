"""An interrupted instance's price changed by a re-check (a cut, or a raise back) does not re-price the credit for
the time already lost: the credit is the price the instance had over each stretch of the time lost (the published
rule: its booked price for the time lost), what was due before the change posted at the old price first.

Before (found by review), the credit was worked out at the start and end of the interruption for the whole time lost
at the price of that moment: a cut to 50 % after an hour lost, then an hour more, credited $3.00 instead of $4.50 on
a $3/h instance, a cut to nothing credited $0 for two hours lost, and the provider kept the difference. A raise
back credited the whole time at the raised price, at the provider's expense."""
import pytest
from django.db.models import Sum

from billing.models import AccountKind, Entry, TransactionKind
from billing.services.credits import credit_due
from marketplace.models import Interruption, Node
from marketplace.services import instances as svc
from provisioning.services.fleet_record import node_record_health
from tests.billing.helpers import fund, node, running
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

PRICE = 3_000_000  # $3/h: 2 GPUs at $1.50


def _interrupted(clock):
    renter = UserFactory()
    fund(renter, "50")
    host = node(price="1.500000", gpu_count=4)
    node_record_health(node_id=host.pk, ok=True)
    instance = running(renter, host, num_gpus=2)
    clock.advance(60)
    node_record_health(node_id=host.pk, ok=True)
    svc.instance_interrupt(instance_id=instance.pk, since=Node.objects.get(pk=host.pk).last_seen_at,
                           cause="vm_lost", detail="the VM stopped")
    return renter, host, instance


def _ledger_credits(renter, provider) -> tuple[int, int]:
    """What service credits put in the renter's wallet and took from the provider's earnings."""
    credits = Entry.objects.filter(transaction__kind=TransactionKind.SERVICE_CREDIT)
    wallet = credits.filter(account__kind=AccountKind.CUSTOMER_WALLET, account__user=renter)
    earnings = credits.filter(account__kind=AccountKind.PROVIDER_EARNINGS, account__user=provider)
    return (wallet.aggregate(t=Sum("amount_micros"))["t"] or 0, earnings.aggregate(t=Sum("amount_micros"))["t"] or 0)


@pytest.mark.parametrize("ratio", [0.5, 0.0])
def test_cut_during_interruption_keeps_credit_for_time_before_it(clock, ratio):
    renter, host, instance = _interrupted(clock)
    clock.advance(3600)
    assert svc.instance_price_cut(instance_id=instance.pk, ratio=ratio, reason="lower score", score_before=100.0)
    clock.advance(3600)
    svc.instance_resume(instance_id=instance.pk)
    interruption = Interruption.objects.get(instance=instance)
    want = (credit_due(price_per_hour_micros=PRICE, lost_seconds=3600)
            + credit_due(price_per_hour_micros=int(PRICE * ratio), lost_seconds=3600))
    assert interruption.credited_micros == want  # $4.50, or $3.00 at a cut to nothing (before: $3.00, $0)
    assert interruption.credited_seconds == 7200
    # Double-entry: what the renter got is what the provider's earnings gave, no more, no less.
    assert _ledger_credits(renter, host.provider) == (want, -want)


def test_a_raise_back_during_an_interruption_credits_the_time_before_it_at_the_cut_price(clock):
    renter, host, instance = _interrupted(clock)
    clock.advance(1800)
    assert svc.instance_price_cut(instance_id=instance.pk, ratio=0.0, reason="rejected", score_before=100.0)
    clock.advance(3600)  # an hour at $0/h: nothing is due for it
    assert svc.instance_price_follow(instance_id=instance.pk, score=100.0)  # back to $3/h
    clock.advance(1800)
    svc.instance_resume(instance_id=instance.pk)
    interruption = Interruption.objects.get(instance=instance)
    half_hour = credit_due(price_per_hour_micros=PRICE, lost_seconds=1800)
    assert interruption.credited_micros == 2 * half_hour  # the $0/h hour credited at $0/h, not at $3/h
    assert _ledger_credits(renter, host.provider) == (2 * half_hour, -2 * half_hour)


def test_a_repeated_change_or_resume_credits_nothing_twice(clock):
    renter, host, instance = _interrupted(clock)
    clock.advance(3600)
    assert svc.instance_price_cut(instance_id=instance.pk, ratio=0.5, reason="lower score", score_before=100.0)
    assert svc.instance_price_cut(instance_id=instance.pk, ratio=1.0, reason="same") is None  # nothing changed
    interruption = Interruption.objects.get(instance=instance)
    assert interruption.credited_micros == credit_due(price_per_hour_micros=PRICE, lost_seconds=3600)
    assert svc.instance_price_cut(instance_id=instance.pk, ratio=0.5, reason="lower still")  # at once: $0.75/h now
    interruption.refresh_from_db()
    assert interruption.credited_micros == credit_due(price_per_hour_micros=PRICE, lost_seconds=3600)
    clock.advance(3600)
    svc.instance_resume(instance_id=instance.pk)
    svc.instance_resume(instance_id=instance.pk)
    interruption.refresh_from_db()
    want = (credit_due(price_per_hour_micros=PRICE, lost_seconds=3600)
            + credit_due(price_per_hour_micros=PRICE // 4, lost_seconds=3600))
    assert interruption.credited_micros == want
    assert _ledger_credits(renter, host.provider) == (want, -want)


def test_an_interruption_without_a_price_change_credits_as_before(clock):
    """One price all along: the credit is the whole time lost at that price, rounded once (cumulative)."""
    renter, host, instance = _interrupted(clock)
    clock.advance(4321)
    svc.instance_resume(instance_id=instance.pk)
    interruption = Interruption.objects.get(instance=instance)
    assert interruption.credited_micros == credit_due(price_per_hour_micros=PRICE, lost_seconds=4321)
    assert _ledger_credits(renter, host.provider) == (interruption.credited_micros, -interruption.credited_micros)
