"""Card money taken back at Stripe: disputes (chargebacks) and refunds made in Stripe's dashboard.

A top-up's credit stays in the wallet only while Stripe keeps the money. Two ways it leaves without the platform
asking, each told by a webhook (billing.services.webhooks) and debited here:

- A dispute: the card holder's bank takes the payment back. `charge.dispute.created` (or `.funds_withdrawn`)
  debits the disputed amount from the renter's wallet, once per dispute (ledger key `dispute:<id>`, kind
  `chargeback`), even below zero: the meter's enforcement then stops their running instances, as at a zero
  balance. An inquiry (status `warning_*`) withdraws no funds and debits nothing. A dispute won
  (`charge.dispute.closed` with status `won`, or `.funds_reinstated`) gives the debit back, once (`dispute-won:<id>`,
  reversing it); one lost takes nothing more. A close that arrives before the dispute was seen posts the debit
  first, so the dispute's own event, later, debits nothing.
- A refund made in Stripe's dashboard rather than with refund_create: `charge.refunded` carries the charge's total
  refunded (`amount_refunded`); what the platform's own refunds of the top-up (pending or succeeded) and earlier
  dashboard refunds do not account for is debited (ledger key `charge-refunded:<top-up>:<cents refunded>`, kind
  `refund`). The platform's own refunds send the same event and debit nothing more here.

An event about a charge that is no top-up's, or whose object cannot be read safely (no id, an amount that is not
whole cents, another currency), raises ChargeEventUnusable: the event is ignored with the reason. One about a top-up
not credited yet raises ValueError: the event fails and Stripe delivers it again (by then the credit is there).
Call inside a transaction (the webhook's): the top-up is locked, so events about one charge apply one at a time.
"""
from typing import Any

from django.db.models import Sum

from billing.models import (
    AccountKind,
    Entry,
    EventKind,
    LedgerTransaction,
    Refund,
    RefundStatus,
    TopUp,
    TopUpStatus,
    TransactionKind,
)
from billing.services.ledger import ledger_post, platform_account, user_account, wallet_balance
from billing.services.notify import event_create
from billing.services.stripe_gateway import MICROS_PER_CENT
from marketplace.money import micros_to_usd, usd_text

DISPUTE_DEBIT_EVENTS = ("charge.dispute.created", "charge.dispute.funds_withdrawn")
DISPUTE_REINSTATED = "charge.dispute.funds_reinstated"
DISPUTE_CLOSED = "charge.dispute.closed"
DISPUTE_EVENTS = (*DISPUTE_DEBIT_EVENTS, DISPUTE_REINSTATED, DISPUTE_CLOSED)
CHARGE_REFUNDED = "charge.refunded"

CHARGEBACK_NOTE = ("Your bank took this card payment back (a dispute), so it was debited from your balance. If the "
                   "dispute is decided in the payment's favour, the amount comes back.")
CHARGEBACK_REVERSED_NOTE = "The dispute of this card payment was decided in its favour: the amount is back."
OUTSIDE_REFUND_NOTE = "Refunded to your card."


class ChargeEventUnusable(ValueError):
    """A genuine event about a charge that is not applied here: not a top-up's, or its object cannot be read safely.
    Ignored, the reason recorded on the event (Stripe's next delivery would carry the same object)."""


def _object_id(obj: dict[str, Any], what: str) -> str:
    value = obj.get("id")
    if not isinstance(value, str) or not value or len(value) > 100:
        raise ChargeEventUnusable(f"The event's {what} has no usable id: nothing was done.")
    return value


def _payment_intent_id(obj: dict[str, Any], what: str, object_id: str) -> str:
    """The PaymentIntent a charge or dispute belongs to (an id, or an expanded object's id)."""
    intent = obj.get("payment_intent")
    if intent is None and isinstance(obj.get("charge"), dict):  # a dispute with its charge expanded
        intent = obj["charge"].get("payment_intent")
    if isinstance(intent, dict):
        intent = intent.get("id")
    if not isinstance(intent, str) or not intent:
        raise ChargeEventUnusable(f"{what} {object_id} names no PaymentIntent: it cannot be matched to a top-up here, "
                                  "so nothing was done.")
    return intent


def _cents(obj: dict[str, Any], name: str, what: str, object_id: str) -> int:
    value = obj.get(name)
    if type(value) is not int or value < 0:
        raise ChargeEventUnusable(f"{what} {object_id}: `{name}` is not a whole number of cents ({str(value)[:40]!r}), "
                                  "so nothing was done.")
    return value


def _top_up_of(obj: dict[str, Any], what: str, object_id: str) -> TopUp:
    """The credited top-up the charge paid, locked."""
    intent_id = _payment_intent_id(obj, what, object_id)
    top_up = (TopUp.objects.select_for_update(of=("self",)).select_related("user")
              .filter(payment_intent_id=intent_id).first())
    if top_up is None:
        raise ChargeEventUnusable(f"{what} {object_id} is of payment {intent_id[:100]}, which paid no top-up here: "
                                  "not a charge of this platform's wallet, so nothing was done.")
    currency = obj.get("currency")
    if not isinstance(currency, str) or currency.lower() != "usd":
        raise ChargeEventUnusable(f"{what} {object_id} is in {str(currency)[:10]!r}, not in usd as top-up {top_up.pk} "
                                  "was: nothing was done.")
    if top_up.status != TopUpStatus.SUCCEEDED:  # Stripe delivers it again; the credit comes first
        raise ValueError(f"{what} {object_id} is of top-up {top_up.pk}, which is {top_up.status}, not credited yet")
    return top_up


def dispute_apply(*, kind: str, dispute: dict[str, Any]) -> bool:
    """Apply a `charge.dispute.*` event (one of DISPUTE_EVENTS) to the top-up it disputes. True when acted on."""
    dispute_id = _object_id(dispute, "dispute")
    top_up = _top_up_of(dispute, "Dispute", dispute_id)
    amount = _cents(dispute, "amount", "Dispute", dispute_id) * MICROS_PER_CENT
    if not 0 < amount <= top_up.amount_micros:
        raise ChargeEventUnusable(f"Dispute {dispute_id} is for {usd_text(amount)}, not an amount of top-up "
                                  f"{top_up.pk} ({usd_text(top_up.amount_micros)}): nothing was done.")
    status = str(dispute.get("status") or "")
    if kind in DISPUTE_DEBIT_EVENTS:
        if kind == "charge.dispute.created" and status.startswith("warning_"):
            raise ChargeEventUnusable(f"Dispute {dispute_id} is an inquiry ({status}): the bank took no money yet, "
                                      "so nothing is debited until it withdraws the funds.")
        _debit(top_up=top_up, dispute=dispute, dispute_id=dispute_id, amount=amount)
        return True
    if kind == DISPUTE_CLOSED and status not in ("won", "lost"):
        raise ChargeEventUnusable(f"Dispute {dispute_id} closed as {status[:40]!r}: no funds were taken, so nothing "
                                  "was done.")
    debit = _debit(top_up=top_up, dispute=dispute, dispute_id=dispute_id, amount=amount)  # if its own event is late
    if kind == DISPUTE_REINSTATED or status == "won":
        _credit_back(top_up=top_up, dispute_id=dispute_id, debit=debit)
    return True


def _debit(*, top_up: TopUp, dispute: dict[str, Any], dispute_id: str, amount: int) -> LedgerTransaction:
    """The dispute's debit of the wallet, posted once (ledger key `dispute:<id>`); the renter told when posted."""
    bank_reason = str(dispute.get("reason") or "not given")[:60]
    txn, created = ledger_post(
        idempotency_key=f"dispute:{dispute_id}", kind=TransactionKind.CHARGEBACK,
        lines=[(user_account(user_id=top_up.user_id, kind=AccountKind.CUSTOMER_WALLET), -amount),
               (platform_account(kind=AccountKind.PAYMENT_CLEARING), amount)],
        memo=f"Dispute {dispute_id} of top-up {top_up.pk} ({top_up.payment_intent_id})",
        reason=f"Chargeback: the card holder's bank took the payment back (Stripe dispute {dispute_id}, "
               f"reason: {bank_reason}).",
        customer_note=CHARGEBACK_NOTE,
    )
    if created:
        left = wallet_balance(user_id=top_up.user_id)
        event_create(
            user=top_up.user, kind=EventKind.CHARGEBACK, email=True,
            message=(f"Your bank took back {usd_text(amount)} of your top-up {top_up.pk} (a dispute of the card "
                     f"payment), so it was debited from your balance, which is now {usd_text(left)}. At or below "
                     "zero your running instances are stopped. If the dispute is decided in the payment's favour, "
                     "the amount comes back."),
            data={"top_up": top_up.pk, "dispute": dispute_id, "transaction": txn.pk,
                  "amount": str(micros_to_usd(amount)), "balance": str(micros_to_usd(left))},
        )
    return txn


def _credit_back(*, top_up: TopUp, dispute_id: str, debit: LedgerTransaction) -> None:
    """A dispute won: its debit given back, once (ledger key `dispute-won:<id>`, reversing the debit)."""
    amount = -(debit.entries.filter(account__kind=AccountKind.CUSTOMER_WALLET)
               .aggregate(total=Sum("amount_micros"))["total"] or 0)
    txn, created = ledger_post(
        idempotency_key=f"dispute-won:{dispute_id}", kind=TransactionKind.REVERSAL, reverses=debit,
        lines=[(user_account(user_id=top_up.user_id, kind=AccountKind.CUSTOMER_WALLET), amount),
               (platform_account(kind=AccountKind.PAYMENT_CLEARING), -amount)],
        memo=f"Dispute {dispute_id} of top-up {top_up.pk} won: the debit given back",
        customer_note=CHARGEBACK_REVERSED_NOTE,
    )
    if created:
        event_create(
            user=top_up.user, kind=EventKind.CHARGEBACK_REVERSED, email=True,
            message=(f"The dispute of your top-up {top_up.pk} was decided in the payment's favour: "
                     f"{usd_text(amount)} is back in your balance."),
            data={"top_up": top_up.pk, "dispute": dispute_id, "transaction": txn.pk,
                  "amount": str(micros_to_usd(amount))},
        )


OUTSIDE_REFUND_KEY = "charge-refunded:{top_up}:{cents}"


def charge_refunded_apply(*, charge: dict[str, Any]) -> bool:
    """Apply `charge.refunded`: debit what the charge's total refunded has beyond what the platform's own refunds
    of the top-up (pending or succeeded) and earlier refunds made at Stripe already account for. True when acted on
    (also when there is nothing left to debit: the platform's own refund)."""
    charge_id = _object_id(charge, "charge")
    top_up = _top_up_of(charge, "Charge", charge_id)
    refunded_cents = _cents(charge, "amount_refunded", "Charge", charge_id)
    refunded = refunded_cents * MICROS_PER_CENT
    if refunded > top_up.amount_micros:
        raise ChargeEventUnusable(f"Charge {charge_id} says {usd_text(refunded)} was refunded, more than its top-up "
                                  f"{top_up.pk} ({usd_text(top_up.amount_micros)}): nothing was done.")
    ours = Refund.objects.filter(top_up=top_up, status__in=[RefundStatus.PENDING, RefundStatus.SUCCEEDED]).aggregate(
        total=Sum("amount_micros"))["total"] or 0
    prefix = OUTSIDE_REFUND_KEY.format(top_up=top_up.pk, cents="")
    outside_before = -(Entry.objects.filter(transaction__idempotency_key__startswith=prefix,
                                            account__kind=AccountKind.CUSTOMER_WALLET)
                       .aggregate(total=Sum("amount_micros"))["total"] or 0)
    left = refunded - ours - outside_before
    if left <= 0:
        return True
    txn, created = ledger_post(
        idempotency_key=OUTSIDE_REFUND_KEY.format(top_up=top_up.pk, cents=refunded_cents), kind=TransactionKind.REFUND,
        lines=[(user_account(user_id=top_up.user_id, kind=AccountKind.CUSTOMER_WALLET), -left),
               (platform_account(kind=AccountKind.PAYMENT_CLEARING), left)],
        memo=f"Refund of top-up {top_up.pk} made at Stripe, not here (charge {charge_id})",
        reason=(f"Refunded in Stripe's dashboard: the charge's refunds total {usd_text(refunded)}, the platform's own "
                f"{usd_text(ours)}, earlier ones made at Stripe {usd_text(outside_before)}."),
        customer_note=OUTSIDE_REFUND_NOTE,
    )
    if created:
        event_create(user=top_up.user, kind=EventKind.REFUND, email=True,
                     message=(f"{usd_text(left)} of your top-up {top_up.pk} was refunded to your card, so it was "
                              f"debited from your balance, which is now "
                              f"{usd_text(wallet_balance(user_id=top_up.user_id))}."),
                     data={"top_up": top_up.pk, "charge": charge_id, "transaction": txn.pk,
                           "amount": str(micros_to_usd(left)), "outside_platform": True})
    return True
