"""Service credits: what a renter gets when the platform lost their running instance (the published rule).

The rule, published at GET /api/v1/billing/terms/ and in docs/ARCHITECTURE.md:
- the time lost is never billed: metering stops at the last moment the node was seen healthy (or the VM seen
  running), and resumes only when the instance runs again;
- on top of that the renter is credited INTERRUPTION_CREDIT_MULTIPLE × the instance's booked price for the time
  lost, counted from that last healthy moment until the instance runs again, fails or is destroyed, at most
  INTERRUPTION_CREDIT_MAX_S per interruption;
- the credit is charged to the provider's earnings (the platform keeps no part of it).

Credits are cumulative, like metering: while an interruption lasts, each posting credits what is due for the
time lost since the last posting (`credited_seconds`) at the instance's price, so totals do not depend on how often
it is posted (at one price, what is due for the whole time lost, rounded once). The booked price is the one the
instance had over each stretch of the time lost: a re-check that changes an interrupted instance's price (a cut, or
a raise back: marketplace.services.instances.pricing) first posts what is due up to then at the old price
(`interruption_credit_before_reprice`), and only the later seconds are credited at the new one. (Before, the whole
time lost was credited at the price of the moment of posting: a cut while interrupted shrank or wiped the credit
for time lost before it, and the provider kept the difference; found by review.) Each posting is one ledger
transaction, the renter's wallet credited and the provider's earnings debited the same amount, whose idempotency key
names the interruption and the seconds it covers.
"""
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction

from billing.models import AccountKind, EventKind, TransactionKind
from billing.services.ledger import ledger_post, span_text, user_account
from billing.services.notify import event_create
from marketplace.models import Instance, Interruption, Node, User
from marketplace.money import micros_to_usd, usd_text


def credit_multiple_bps() -> int:
    """INTERRUPTION_CREDIT_MULTIPLE in basis points of the price (1 → 10000)."""
    multiple = Decimal(settings.INTERRUPTION_CREDIT_MULTIPLE)
    bps = multiple * 10_000
    if bps != bps.to_integral_value() or not 0 <= bps <= 100 * 10_000:
        raise ImproperlyConfigured(f"INTERRUPTION_CREDIT_MULTIPLE must be 0 to 100 with at most four decimals, "
                                   f"not {multiple}")
    return int(bps)


def credit_due(*, price_per_hour_micros: int, lost_seconds: int) -> int:
    """The whole credit an interruption of `lost_seconds` earns at this price (capped, rounded down)."""
    seconds = min(max(lost_seconds, 0), settings.INTERRUPTION_CREDIT_MAX_S)
    return price_per_hour_micros * seconds * credit_multiple_bps() // (3600 * 10_000)


@dataclass(frozen=True)
class CreditPosted:
    amount_micros: int  # posted now
    total_micros: int  # credited for this interruption so far


def interruption_credit(*, interruption_id: int, until: datetime) -> CreditPosted:
    """Credit the renter what the interruption has earned up to `until` (its end once ended) and not yet got: the
    seconds lost since those credited so far, at the instance's price now (its price over them: a price change
    posts the credit due before it first, interruption_credit_before_reprice).

    Runs in its own transaction (or the caller's) with the interruption row locked; idempotent.
    """
    with transaction.atomic():
        interruption = Interruption.objects.select_for_update().get(pk=interruption_id)
        instance = Instance.objects.only("renter_id", "node_id", "price_per_hour_micros").get(
            pk=interruption.instance_id)
        lost = min(interruption.lost_seconds(until), settings.INTERRUPTION_CREDIT_MAX_S)
        if lost <= interruption.credited_seconds:
            return CreditPosted(0, interruption.credited_micros)
        price = instance.price_per_hour_micros
        # Cumulative from the last posting (the base): at one price all along, the whole credit rounded once.
        amount = (credit_due(price_per_hour_micros=price, lost_seconds=lost)
                  - credit_due(price_per_hour_micros=price, lost_seconds=interruption.credited_seconds))
        due = interruption.credited_micros + amount
        # The seconds are credited even when nothing is due for them (a price of $0/h): a later price must not
        # credit them again.
        Interruption.objects.filter(pk=interruption.pk).update(credited_seconds=lost, credited_micros=due)
        if amount <= 0:
            return CreditPosted(0, due)
        provider_id = Node.objects.values_list("provider_id", flat=True).get(pk=instance.node_id)
        ledger_post(
            idempotency_key=f"interruption:{interruption.pk}:{lost}", kind=TransactionKind.SERVICE_CREDIT,
            lines=[(user_account(user_id=instance.renter_id, kind=AccountKind.CUSTOMER_WALLET), amount),
                   (user_account(user_id=provider_id, kind=AccountKind.PROVIDER_EARNINGS), -amount)],
            memo=f"Instance {interruption.instance_id} interrupted: {lost} s lost "
                 f"{span_text(interruption.started_at, until)}",
            reason="Service credit by the published interruption rule.",
            customer_note="Service credit for the time your instance was out of your reach.",
        )
        event_create(
            user=User.objects.get(pk=provider_id), kind=EventKind.SERVICE_CREDIT,
            message=(f"{usd_text(amount)} was charged to your earnings as a service credit: instance "
                     f"{interruption.instance_id} on node {instance.node_id} was out of its renter's reach "
                     f"({interruption.get_cause_display().lower()})."),
            data={"instance": interruption.instance_id, "node": instance.node_id, "amount": str(micros_to_usd(amount)),
                  "interruption": interruption.pk},
        )
        return CreditPosted(amount, due)


def interruption_credit_before_reprice(*, instance_id: int, until: datetime) -> CreditPosted | None:
    """Post what the instance's open interruption has earned up to `until` at the price it has now; None when it
    has none. Call under the instance's lock (then the interruption's, as every interruption path takes them), just
    before its price changes: the time lost until then is credited at the price it had, later time at the new one."""
    interruption_id = (Interruption.objects.filter(instance_id=instance_id, ended_at=None)
                       .values_list("pk", flat=True).first())
    if interruption_id is None:
        return None
    return interruption_credit(interruption_id=interruption_id, until=until)


def credit_terms() -> dict[str, str | int]:
    """The published rule, for the terms endpoint and the pages."""
    return {
        "credit_multiple": str(Decimal(credit_multiple_bps()) / 10_000),
        "credit_max_seconds": settings.INTERRUPTION_CREDIT_MAX_S,
        "charged_to": "provider_earnings",
    }
