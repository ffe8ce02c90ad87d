"""Card money taken back by the card holder's bank: disputes (chargebacks), told by Stripe's `charge.dispute.*`.

A top-up's credit stays in the wallet only while Stripe keeps the money. `charge.dispute.created` (or
`.funds_withdrawn`) debits the disputed amount from the renter's wallet, once per dispute (ledger key
`dispute:<id>`, kind `chargeback`; the Dispute row keeps it with its top-up), even below zero: the meter's
enforcement then stops their running instances, as at a zero balance. An inquiry (status `warning_*`) withdraws no
funds and debits nothing. A dispute won (`charge.dispute.closed` with status `won`, or `.funds_reinstated`) gives the
debit back, once (`dispute-won:<id>`, reversing it); one lost takes nothing more. A close that arrives before the
dispute was seen posts the debit first, so the dispute's own event, later, debits nothing. While a dispute holds its
amount (debited, not given back) that amount cannot be refunded (billing.services.refunds.refundable_micros).

A dispute over more than what was left of its top-up after refunds (a charge partly refunded, then disputed in full)
is debited in full all the same: Stripe withdraws the disputed amount whatever was refunded, and the merchant gets it
back by answering the dispute with the refund as evidence, so such a dispute is usually won. The renter's notice (the
event and the debit's customer note) says that part of the payment was already refunded, and the debit's reason and
a warning in the log tell operators to answer it with the refund (the dispute's admin page shows it too: review r55).

A dispute is matched to its top-up by its PaymentIntent or, when it names only its charge (a charge made without a
PaymentIntent, or an older API version), by that charge (billing.services.charges). One that is no top-up's, or whose
object cannot be read safely (no id, an amount that is not whole cents, another currency), raises
ChargeEventUnusable: the event is ignored with the reason. One about a top-up not credited yet raises ValueError: the
event fails and Stripe delivers it again (by then the credit is there). Call inside a transaction (the webhook's):
the top-up is locked, so events about one charge apply one at a time. Refunds, whoever made them, are
billing.services.refunds'.
"""
import logging
from typing import Any

from django.db.models import Sum

from billing.models import AccountKind, Dispute, EventKind, RefundStatus, TopUp, TransactionKind
from billing.services.charges import ChargeEventUnusable, StripeLookups, object_id, top_up_for, whole_cents
from billing.services.ledger import ledger_post, platform_account, user_account, wallet_balance
from billing.services.notify import event_create
from billing.services.stripe_gateway import MICROS_PER_CENT
from marketplace.money import micros_to_usd, usd_text

__all__ = ["DISPUTE_EVENTS", "ChargeEventUnusable", "dispute_apply", "refunded_micros"]

log = logging.getLogger(__name__)

DISPUTE_DEBIT_EVENTS = ("charge.dispute.created", "charge.dispute.funds_withdrawn")
DISPUTE_REINSTATED = "charge.dispute.funds_reinstated"
DISPUTE_CLOSED = "charge.dispute.closed"
DISPUTE_EVENTS = (*DISPUTE_DEBIT_EVENTS, DISPUTE_REINSTATED, DISPUTE_CLOSED)

CHARGEBACK_NOTE = ("Your bank took this card payment back (a dispute), so it was debited from your balance. If the "
                   "dispute is decided in the payment's favour, the amount comes back.")
CHARGEBACK_OVER_REFUNDS_NOTE = (
    "Your bank took this card payment back (a dispute), so it was debited from your balance, though part of the "
    "payment had already been refunded to your card. We answer the dispute with that refund: if it is decided in "
    "the payment's favour, the amount comes back.")
CHARGEBACK_REVERSED_NOTE = "The dispute of this card payment was decided in its favour: the amount is back."


def dispute_apply(*, kind: str, dispute: dict[str, Any], looked: StripeLookups | None = None) -> bool:
    """Apply a `charge.dispute.*` event (one of DISPUTE_EVENTS) to the top-up it disputes. True when acted on."""
    dispute_id = object_id(dispute, "dispute")
    top_up = top_up_for(dispute, "Dispute", dispute_id, looked)
    amount = whole_cents(dispute, "amount", "Dispute", dispute_id) * MICROS_PER_CENT
    if not 0 < amount <= top_up.amount_micros:
        raise ChargeEventUnusable(f"Dispute {dispute_id} is for {usd_text(amount)}, not an amount of top-up "
                                  f"{top_up.pk} ({usd_text(top_up.amount_micros)}): nothing was done.")
    status = dispute.get("status") or ""
    if not isinstance(status, str):  # a list or object read as text was taken for a status that is no inquiry
        raise ChargeEventUnusable(f"Dispute {dispute_id}: `status` is not a status ({str(status)[:40]!r}), so nothing "
                                  "was done.")
    if kind in DISPUTE_DEBIT_EVENTS:
        if kind == "charge.dispute.created" and status.startswith("warning_"):
            raise ChargeEventUnusable(f"Dispute {dispute_id} is an inquiry ({status}): the bank took no money yet, "
                                      "so nothing is debited until it withdraws the funds.")
        _debit(top_up=top_up, dispute=dispute, dispute_id=dispute_id, amount=amount)
        return True
    if kind == DISPUTE_CLOSED and status not in ("won", "lost"):
        raise ChargeEventUnusable(f"Dispute {dispute_id} closed as {status[:40]!r}: no funds were taken, so nothing "
                                  "was done.")
    record = _debit(top_up=top_up, dispute=dispute, dispute_id=dispute_id, amount=amount)  # if its own event is late
    if kind == DISPUTE_REINSTATED or status == "won":
        _credit_back(top_up=top_up, record=record)
    return True


def _debit(*, top_up: TopUp, dispute: dict[str, Any], dispute_id: str, amount: int) -> Dispute:
    """The dispute's debit of the wallet, posted once (ledger key `dispute:<id>`, kept on its Dispute row); the
    renter told when posted."""
    bank_reason = str(dispute.get("reason") or "not given")[:60]
    record, _ = Dispute.objects.get_or_create(stripe_dispute_id=dispute_id, defaults={
        "top_up": top_up, "amount_micros": amount, "bank_reason": bank_reason})
    if record.top_up_id != top_up.pk:
        raise ChargeEventUnusable(f"Dispute {dispute_id} was recorded of top-up {record.top_up_id}, and is now said to "
                                  f"be of top-up {top_up.pk}: nothing was done.")
    if record.debit_id is not None:
        return record
    refunded = refunded_micros(top_up=top_up)
    over_refunds = amount > top_up.amount_micros - refunded  # more than what was left unrefunded: usually won
    reason = (f"Chargeback: the card holder's bank took the payment back (Stripe dispute {dispute_id}, "
              f"reason: {bank_reason}).")
    if over_refunds:
        reason += (f" Dispute over a refunded charge: {usd_text(refunded)} of the {usd_text(top_up.amount_micros)} "
                   f"top-up was already refunded, and {usd_text(amount)} is disputed. Answer the dispute at Stripe "
                   "with the refund as evidence: such a dispute is usually won.")
    txn, created = ledger_post(
        idempotency_key=f"dispute:{dispute_id}", kind=TransactionKind.CHARGEBACK,
        lines=[(user_account(user_id=top_up.user_id, kind=AccountKind.CUSTOMER_WALLET), -amount),
               (platform_account(kind=AccountKind.PAYMENT_CLEARING), amount)],
        memo=f"Dispute {dispute_id} of top-up {top_up.pk} ({top_up.payment_intent_id})",
        reason=reason,
        customer_note=CHARGEBACK_OVER_REFUNDS_NOTE if over_refunds else CHARGEBACK_NOTE,
    )
    if created:
        if over_refunds:
            log.warning("dispute %s of top-up %s is for %s, but %s of its %s was already refunded: for an operator, "
                        "answer it at Stripe with the refund as evidence", dispute_id, top_up.pk, usd_text(amount),
                        usd_text(refunded), usd_text(top_up.amount_micros))
        left = wallet_balance(user_id=top_up.user_id)
        already = (f" {usd_text(refunded)} of this top-up had already been refunded to your card: we answer the "
                   "dispute with that refund." if over_refunds else "")
        event_create(
            user=top_up.user, kind=EventKind.CHARGEBACK, email=True,
            message=(f"Your bank took back {usd_text(amount)} of your top-up {top_up.pk} (a dispute of the card "
                     f"payment), so it was debited from your balance, which is now {usd_text(left)}.{already} At "
                     "or below zero your running instances are stopped. If the dispute is decided in the payment's "
                     "favour, the amount comes back."),
            data={"top_up": top_up.pk, "dispute": dispute_id, "transaction": txn.pk,
                  "amount": str(micros_to_usd(amount)), "balance": str(micros_to_usd(left)),
                  **({"refunded": str(micros_to_usd(refunded))} if over_refunds else {})},
        )
    record.debit = txn
    record.save(update_fields=["debit", "updated_at"])
    return record


def _credit_back(*, top_up: TopUp, record: Dispute) -> None:
    """A dispute won: its debit given back, once (ledger key `dispute-won:<id>`, reversing the debit)."""
    if record.reversal_id is not None:
        return
    debit, dispute_id = record.debit, record.stripe_dispute_id
    assert debit is not None  # _debit posted it
    amount = record.amount_micros  # what _debit took from the wallet
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
    record.reversal = txn
    record.save(update_fields=["reversal", "updated_at"])


def refunded_micros(*, top_up: TopUp) -> int:
    """What of a top-up was refunded to the card, or is being refunded: its refunds not failed, whoever made them
    (the platform's, pending or debited, and those made at Stripe)."""
    return top_up.refunds.filter(status__in=[RefundStatus.PENDING, RefundStatus.SUCCEEDED]).aggregate(
        total=Sum("amount_micros"))["total"] or 0
