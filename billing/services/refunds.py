"""Refunds: (part of) a top-up given back to its card, by an operator.

A refund reserves its amount (a `pending` Refund, under a lock on the top-up and the wallet), calls
Stripe, and on success posts the reversal (wallet → payment clearing) keyed by the Stripe refund id.
When Stripe's answer is lost (no answer, a 5xx, an idempotency conflict), Stripe may have refunded: the refund
stays pending, its amount reserved so that no second refund can give it back again, until
billing.services.reconcile.refunds_reconcile finds Stripe's refund for it (by its metadata) and settles it.
A refund Stripe made can still fail later (its `refund.failed` or `charge.refund.updated` webhook, status failed
or canceled): the card never got the money, so the wallet's debit is reversed and the customer told
(`refund_failed_at_stripe`).
"""
from typing import Any

import stripe
from django.db import IntegrityError, transaction
from django.db.models import Sum

from billing.models import Account, AccountKind, EventKind, Refund, RefundStatus, TopUp, TopUpStatus, TransactionKind
from billing.services.ledger import ledger_post, platform_account, user_account
from billing.services.notify import event_create
from billing.services.stripe_gateway import MICROS_PER_CENT, cents, client, is_definite, translate
from core.errors import Conflict, IdempotencyKeyReused, Unavailable, ValidationFailed
from marketplace.models import User
from marketplace.money import micros_to_usd, usd_text


def refundable_micros(*, top_up: TopUp) -> int:
    if top_up.status != TopUpStatus.SUCCEEDED:
        return 0
    taken = top_up.refunds.filter(status__in=[RefundStatus.PENDING, RefundStatus.SUCCEEDED]).aggregate(
        total=Sum("amount_micros"))["total"] or 0
    return top_up.amount_micros - taken


REFUND_NOTE = "Refunded to your card."


def refund_for_idempotency_key(*, created_by: User, idempotency_key: str, request_fingerprint: str) -> Refund | None:
    """The refund an earlier request of this operator with this key made, or None.

    Raises IdempotencyKeyReused (422) when that request had another body."""
    existing = Refund.objects.filter(created_by=created_by, idempotency_key=idempotency_key).first()
    if existing is not None and existing.request_fingerprint != request_fingerprint:
        raise IdempotencyKeyReused(
            f"This Idempotency-Key was already used for a different refund ({existing.pk}, of top-up "
            f"{existing.top_up_id}). Send the same body to get that refund again, or use a new key.")
    return existing


def refund_create(*, top_up: TopUp, amount_micros: int, reason: str, created_by: User,
                  customer_note: str = "") -> Refund:
    """Give (part of) a top-up back to its card and debit the wallet. Operators only.

    `reason` is the operator's (operators only); `customer_note` is what the customer reads (REFUND_NOTE when not
    given).

    The amount is reserved first (a pending refund, under locks on the top-up and the wallet), so that
    two refunds at once cannot give back more than was paid, or more than the customer has left.
    """
    refund, _ = refund_create_once(top_up=top_up, amount_micros=amount_micros, reason=reason,
                                   created_by=created_by, customer_note=customer_note)
    return refund


def refund_create_once(*, top_up: TopUp, amount_micros: int, reason: str, created_by: User,
                       customer_note: str = "", idempotency_key: str = "",
                       request_fingerprint: str = "") -> tuple[Refund, bool]:
    """refund_create for a request that may come twice (an API retry, an admin form sent again): returns (refund,
    created). With an `idempotency_key` this operator used before and the same body: the earlier refund (in
    whatever state it is now) and False, and nothing is refunded again; with another body, IdempotencyKeyReused
    (422). The database decides a race between the two (refund_unique_idempotency_key), not a look before."""
    if type(amount_micros) is not int or amount_micros <= 0 or amount_micros % MICROS_PER_CENT:
        raise ValidationFailed("Refund a positive amount in whole cents.", field="amount")
    if not reason.strip():
        raise ValidationFailed("Give a reason.", field="reason")
    fingerprint = request_fingerprint if idempotency_key else ""
    if idempotency_key:
        existing = refund_for_idempotency_key(created_by=created_by, idempotency_key=idempotency_key,
                                              request_fingerprint=fingerprint)
        if existing is not None:
            return existing, False
    try:
        refund = _refund_reserve(top_up=top_up, amount_micros=amount_micros, reason=reason, created_by=created_by,
                                 customer_note=customer_note, idempotency_key=idempotency_key,
                                 request_fingerprint=fingerprint)
    except IntegrityError:
        # The same key's other request reserved first (refund_unique_idempotency_key): answer with its refund.
        if idempotency_key:
            existing = refund_for_idempotency_key(created_by=created_by, idempotency_key=idempotency_key,
                                                  request_fingerprint=fingerprint)
            if existing is not None:
                return existing, False
        raise
    return _refund_send(refund=refund), True


def _refund_reserve(*, top_up: TopUp, amount_micros: int, reason: str, created_by: User, customer_note: str,
                    idempotency_key: str, request_fingerprint: str) -> Refund:
    """The pending refund, its amount reserved under locks on the top-up and the wallet."""
    with transaction.atomic():
        top_up = TopUp.objects.select_for_update().get(pk=top_up.pk)
        if top_up.status != TopUpStatus.SUCCEEDED or not top_up.payment_intent_id:
            raise Conflict(f"Only a credited top-up can be refunded; this one is {top_up.status}.")
        left = refundable_micros(top_up=top_up)
        if amount_micros > left:
            raise Conflict(f"At most {usd_text(left)} of this top-up can still be refunded.")
        wallet = user_account(user_id=top_up.user_id, kind=AccountKind.CUSTOMER_WALLET)
        wallet = Account.objects.select_for_update().get(pk=wallet.pk)
        reserved = Refund.objects.filter(top_up__user_id=top_up.user_id, status=RefundStatus.PENDING).aggregate(
            total=Sum("amount_micros"))["total"] or 0
        if amount_micros > wallet.balance_micros - reserved:
            raise Conflict(
                f"The customer's balance is {usd_text(wallet.balance_micros - reserved)}: the rest was spent. "
                "Refund at most that much."
            )
        return Refund.objects.create(top_up=top_up, amount_micros=amount_micros, reason=reason,
                                     customer_note=customer_note.strip() or REFUND_NOTE, created_by=created_by,
                                     idempotency_key=idempotency_key, request_fingerprint=request_fingerprint)


def _refund_send(*, refund: Refund) -> Refund:
    """Ask Stripe for a reserved refund (outside any transaction) and record its answer."""
    top_up = refund.top_up
    assert top_up.payment_intent_id is not None  # _refund_reserve refunds only a top-up Stripe charged
    try:
        answer = client().v1.refunds.create(
            params={"payment_intent": top_up.payment_intent_id, "amount": cents(refund.amount_micros),
                    "metadata": {"refund_id": str(refund.pk), "top_up_id": str(top_up.pk)}},
            options={"idempotency_key": f"refund-{refund.pk}"},
        )
    except stripe.StripeError as exc:
        error = translate(exc, "refunding the card")
        if not is_definite(exc):  # Stripe may have refunded: the amount stays reserved until it is asked
            Refund.objects.filter(pk=refund.pk, status=RefundStatus.PENDING).update(
                failure_message=f"Outcome unknown: {error.message}"[:500])
            raise Unavailable(
                f"The payment provider's answer to refund {refund.pk} was lost, so whether the card was refunded is "
                "not known yet. The refund stays pending, its amount reserved, and is settled with what the payment "
                "provider says within a few minutes: do not refund it again.", extra={"refund": refund.pk}) from None
        Refund.transition_rows(Refund.objects.filter(pk=refund.pk), RefundStatus.FAILED,
                               failure_message=error.message[:500])
        raise error from None
    if answer.status in ("failed", "canceled"):
        Refund.transition_rows(Refund.objects.filter(pk=refund.pk), RefundStatus.FAILED,
                               failure_message=f"The payment provider says the refund {answer.status}.")
        raise Conflict(f"The payment provider says the refund {answer.status}; nothing was debited.")
    confirmed = refund_confirm(refund_id=refund.pk, stripe_refund_id=answer.id)
    if confirmed.status == RefundStatus.FAILED:  # Stripe's refund.failed came first (refund_confirm leaves it)
        raise Conflict(f"{confirmed.failure_message} The refund failed; nothing was debited.")
    return confirmed


def refund_confirm(*, refund_id: int, stripe_refund_id: str) -> Refund:
    """Post the refund's reversal (wallet → payment clearing), once: idempotent on the Stripe refund id."""
    with transaction.atomic():
        refund = Refund.objects.select_for_update().select_related("top_up__user").get(pk=refund_id)
        if refund.status == RefundStatus.SUCCEEDED:
            return refund
        if refund.status == RefundStatus.FAILED and refund.stripe_refund_id == stripe_refund_id:
            # Stripe's refund.failed for this very refund came while its create's answer was on the way (found
            # by review: the wallet was debited for a refund Stripe said failed). Failed stays failed.
            return refund
        top_up = refund.top_up
        txn, _ = ledger_post(
            idempotency_key=f"refund:{stripe_refund_id}", kind=TransactionKind.REFUND,
            lines=[(user_account(user_id=top_up.user_id, kind=AccountKind.CUSTOMER_WALLET), -refund.amount_micros),
                   (platform_account(kind=AccountKind.PAYMENT_CLEARING), refund.amount_micros)],
            memo=f"Refund {refund.pk} of top-up {top_up.pk} ({stripe_refund_id})", reason=refund.reason,
            customer_note=refund.customer_note, created_by=refund.created_by,
        )
        refund.transition_to(RefundStatus.SUCCEEDED)
        refund.stripe_refund_id = stripe_refund_id
        refund.transaction = txn
        refund.failure_message = ""
        refund.save(update_fields=["status", "stripe_refund_id", "transaction", "failure_message"])
        event_create(user=top_up.user, kind=EventKind.REFUND,
                     message=f"{usd_text(refund.amount_micros)} of your top-up {top_up.pk} was refunded to "
                             f"your card: {refund.customer_note or REFUND_NOTE}",
                     data={"top_up": top_up.pk, "refund": refund.pk,
                           "amount": str(micros_to_usd(refund.amount_micros))})
    return refund


def refund_failed_at_stripe(*, stripe_refund: dict[str, Any]) -> bool:
    """Stripe says a refund failed or was canceled after it was made. Debited here already: the debit is
    reversed (once: ledger key `refund-failed:<id>`), the refund failed, and the customer told; still pending
    here: failed, its amount refundable again. Call inside a transaction. False when it is no refund of ours."""
    refund_id = str((stripe_refund.get("metadata") or {}).get("refund_id") or "")
    query = Refund.objects.select_for_update().select_related("top_up__user")
    refund = query.filter(stripe_refund_id=stripe_refund.get("id")).first() if stripe_refund.get("id") else None
    if refund is None and refund_id.isascii() and refund_id.isdigit():
        refund = query.filter(pk=int(refund_id)).first()
    if refund is None:
        return False
    why = (stripe_refund.get("failure_reason") or "").replace("_", " ")
    told = f"The payment provider says the refund {stripe_refund.get('status')}{f' ({why})' if why else ''}."
    if refund.status == RefundStatus.PENDING:
        # Its Stripe id recorded with it: refund_confirm, with the create's answer still on its way, must not
        # take this refund for one that was made after all.
        Refund.transition_rows(Refund.objects.filter(pk=refund.pk), RefundStatus.FAILED,
                               stripe_refund_id=refund.stripe_refund_id or stripe_refund.get("id") or None,
                               failure_message=f"{told} Nothing was debited."[:500])
        return True
    if refund.status != RefundStatus.SUCCEEDED or refund.transaction is None:
        return True  # failed here already: nothing was debited
    top_up = refund.top_up
    ledger_post(
        idempotency_key=f"refund-failed:{refund.pk}", kind=TransactionKind.REVERSAL, reverses=refund.transaction,
        lines=[(user_account(user_id=top_up.user_id, kind=AccountKind.CUSTOMER_WALLET), refund.amount_micros),
               (platform_account(kind=AccountKind.PAYMENT_CLEARING), -refund.amount_micros)],
        memo=f"Refund {refund.pk} of top-up {top_up.pk} failed at Stripe ({refund.stripe_refund_id})",
    )
    refund.transition_to(RefundStatus.FAILED)
    refund.failure_message = f"{told} The amount is back in the balance."[:500]
    refund.save(update_fields=["status", "failure_message"])
    event_create(user=top_up.user, kind=EventKind.REFUND,
                 message=f"The refund of {usd_text(refund.amount_micros)} of your top-up {top_up.pk} to your card "
                         f"failed at the payment provider; {usd_text(refund.amount_micros)} is back in your balance.",
                 data={"top_up": top_up.pk, "refund": refund.pk, "failed": True,
                       "amount": str(micros_to_usd(refund.amount_micros))}, email=True)
    return True
