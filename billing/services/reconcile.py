"""Top-ups whose webhook never came: ask Stripe, and settle them the way the webhook would have.

A top-up is `processing` from the moment Stripe took the payment until the signed `payment_intent.succeeded`
webhook credits it. If that webhook is lost (an endpoint misconfigured, an outage longer than Stripe's retries),
the top-up would stay processing and the money would never show. Every minute (billing.tasks.top_ups_reconcile)
the top-ups processing for longer than BILLING_TOP_UP_RECONCILE_AFTER_S are looked up at Stripe:

- succeeded: credited through `webhooks.payment_intent_apply`, the webhook's own path. Whichever of the two comes
  first credits; the other finds the top-up credited under its row lock (and the ledger key `top-up:<id>` taken)
  and changes nothing;
- canceled, or back to `requires_payment_method` (the charge failed): failed, with the usual event;
- anything else (still processing): left alone, and asked again after the same delay.

An automatic top-up is charged by a task queued when it is created (billing.tasks.top_up_charge). If that task
was never queued (the broker was down) or its message was lost, the top-up would stay pending: the same run
charges the automatic top-ups still pending after BILLING_TOP_UP_RECONCILE_AFTER_S (`top_ups_charge_pending`).
The charge's Stripe idempotency key (`top-up-<id>`) makes a charge that ran meanwhile answer the same payment.
Either way the charge first reads the owner's profile and account again (top_ups._auto_top_up_still_wanted): one
whose owner turned auto top-up off or changed its card or amount since, or whose account was deactivated, is
ended as not charged instead.

A manual or automatic top-up whose charge answer was lost (no answer, a 5xx, a 409) is failed with
`outcome_unknown`: Stripe may have charged. Its webhook credits it if it did; if that webhook is lost too, the
same run looks the payment up after the same delay among the customer's payments made since the top-up, by the
top-up id in their metadata (`top_ups_find_lost`): found, it is applied as the webhook would (credited, failed,
or processing and followed as above); not found, the charge never reached Stripe and the top-up says the card was
not charged.

A refund whose Stripe answer was lost stays pending, its amount held from the wallet (billing.services.refunds).
After the same delay the same run looks for Stripe's refund carrying its id in the metadata (`refunds_reconcile`):
found and not failed (succeeded, or not finished at Stripe: pending, requires_action), it is made once
(`refund_confirm`: its hold goes to payment clearing, or the wallet is debited for one pending from before holds;
a later failure at Stripe gives it back); found failed or canceled, or not found at all (the request never reached
Stripe), the refund fails, its hold goes back to the wallet once (`refund_not_made`), and its amount is refundable
again.

Stripe is called outside any database transaction. A Stripe error never stops the loop for good: an unreachable
or failing Stripe ends this run (the next one tries again), any other error skips that top-up until its next turn.
"""
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any

import stripe
from django.conf import settings
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from billing.models import BillingProfile, Refund, RefundStatus, TopUp, TopUpStatus
from billing.services.refunds import refund_confirm, refund_not_made
from billing.services.stripe_gateway import client, translate
from billing.services.top_ups import top_up_charge_by_id
from billing.services.webhooks import EventUnusable, payment_failure_reason, payment_intent_apply
from core.errors import Unavailable
from core.locks import advisory_lock

log = logging.getLogger(__name__)

RECONCILE_BATCH = 100  # top-ups looked up per run at most (the oldest-checked first)
FAILED_STATUSES = ("canceled", "requires_payment_method")


class StripeUnavailable(Exception):
    """Stripe cannot be reached or failed: stop this run, the next one tries again."""


def _each_until_stripe_is_away(ids: list[int], follow: Callable[[int], str], what: str) -> dict[str, int]:
    """`follow` each id in turn, counting its outcomes; Stripe unreachable ends the run there (counted as
    `stripe_unavailable`): the rest wait for the next run rather than each timing out in turn."""
    summary: Counter[str] = Counter()
    for pk in ids:
        try:
            summary[follow(pk)] += 1
        except StripeUnavailable as exc:
            log.warning("%s: %s; the next run tries again", what, exc)
            summary["stripe_unavailable"] += 1
            break
    return dict(summary)


def top_ups_reconcile(*, now: datetime | None = None, limit: int = RECONCILE_BATCH) -> Mapping[str, int | str]:
    """Settle the top-ups still processing after BILLING_TOP_UP_RECONCILE_AFTER_S with what Stripe says (one run
    at a time). Returns how many were credited, failed, left processing, or could not be looked up."""
    with advisory_lock("billing.top_ups_reconcile") as acquired:
        if not acquired:
            return {"skipped": "another run is reconciling top-ups"}
        now = now or timezone.now()
        cutoff = now - timedelta(seconds=settings.BILLING_TOP_UP_RECONCILE_AFTER_S)
        # updated_at: when it became processing, or when it was last looked up here (see _looked_up).
        ids = list(TopUp.objects.filter(status=TopUpStatus.PROCESSING, payment_intent_id__isnull=False,
                                        updated_at__lt=cutoff)
                   .order_by("updated_at", "pk").values_list("pk", flat=True)[:limit])
        return _each_until_stripe_is_away(ids, lambda pk: top_up_reconcile(top_up_id=pk, now=now), "top-up reconcile")


def top_ups_charge_pending(*, now: datetime | None = None, limit: int = RECONCILE_BATCH) -> int:
    """Charge the automatic top-ups still pending after BILLING_TOP_UP_RECONCILE_AFTER_S: their charge task was
    never queued (the broker was down) or was lost. One run at a time; returns how many were charged (or failed, or
    ended as not charged: auto top-up turned off or changed since, or the account deactivated)."""
    with advisory_lock("billing.top_ups_charge_pending") as acquired:
        if not acquired:
            return 0
        cutoff = (now or timezone.now()) - timedelta(seconds=settings.BILLING_TOP_UP_RECONCILE_AFTER_S)
        ids = list(TopUp.objects.filter(status=TopUpStatus.PENDING, automatic=True, card__isnull=False,
                                        created_at__lt=cutoff)
                   .order_by("created_at", "pk").values_list("pk", flat=True)[:limit])
        for top_up_id in ids:
            log.warning("automatic top-up %s: still pending (its charge was never queued or was lost); charging it",
                        top_up_id)
            top_up_charge_by_id(top_up_id=top_up_id)
        return len(ids)


def top_ups_find_lost(*, now: datetime | None = None, limit: int = RECONCILE_BATCH) -> Mapping[str, int | str]:
    """Look up at Stripe the top-ups whose charge answer was lost (failed with `outcome_unknown`) for longer than
    BILLING_TOP_UP_RECONCILE_AFTER_S; one run at a time. Returns how many were credited, failed, are processing,
    were not charged, or could not be looked up."""
    with advisory_lock("billing.top_ups_find_lost") as acquired:
        if not acquired:
            return {"skipped": "another run is looking up lost charges"}
        now = now or timezone.now()
        cutoff = now - timedelta(seconds=settings.BILLING_TOP_UP_RECONCILE_AFTER_S)
        _pending_answers_lost(cutoff, now)
        ids = list(TopUp.objects.filter(status=TopUpStatus.FAILED, outcome_unknown=True, updated_at__lt=cutoff)
                   .order_by("updated_at", "pk").values_list("pk", flat=True)[:limit])
        return _each_until_stripe_is_away(ids, lambda pk: top_up_find_lost(top_up_id=pk, now=now), "lost charges")


def _pending_answers_lost(cutoff: datetime, now: datetime) -> None:
    """Top-ups still pending at the cutoff that no other follow-up charges (a manual one, whose request died
    while Stripe was charging: a worker killed at its timeout raises no StripeError; an automatic one whose card
    was removed) had their answer lost: they are looked up from here as such (found by review: a charged card was
    never credited, and the balance page showed it in flight for good)."""
    stale = TopUp.objects.filter(Q(automatic=False) | Q(card__isnull=True), status=TopUpStatus.PENDING,
                                 created_at__lt=cutoff)
    # updated_at as old as the top-up: this same run looks them up.
    moved = TopUp.transition_rows(stale, TopUpStatus.FAILED, outcome_unknown=True, updated_at=F("created_at"),
                                  failure_message=(
        "The payment provider's answer was lost. If your card was charged, the top-up is credited within minutes; "
        "do not top up again until then."))
    if moved:
        log.warning("%s top-up(s) still pending past %s: their answer was lost; looking them up at Stripe", moved,
                    now - cutoff)


# How far before the top-up's row the payment may be stamped (the two clocks differ a little).
LOST_CHARGE_CLOCK_SLACK = timedelta(minutes=5)


def top_up_find_lost(*, top_up_id: int, now: datetime | None = None) -> str:
    """Find the payment of one top-up whose charge answer was lost and apply it. Returns "succeeded", "failed",
    "processing" (now followed as a processing top-up), "not_charged", "settled" (known meanwhile: nothing to do)
    or "error" (logged; looked up again after the same delay). Raises StripeUnavailable."""
    now = now or timezone.now()
    top_up = TopUp.objects.filter(pk=top_up_id, status=TopUpStatus.FAILED, outcome_unknown=True).first()
    if top_up is None:
        return "settled"
    customer = BillingProfile.objects.filter(user_id=top_up.user_id).values_list("stripe_customer_id",
                                                                                    flat=True).first()
    intent = None
    if top_up.payment_intent_id or customer:
        try:
            if top_up.payment_intent_id:  # Stripe's error named it (the charge was refused or is under way)
                intent = client().v1.payment_intents.retrieve(top_up.payment_intent_id)
            else:
                since = int((top_up.created_at - LOST_CHARGE_CLOCK_SLACK).timestamp())
                page = client().v1.payment_intents.list(params={"customer": customer or "", "limit": 100,
                                                                "created": {"gte": since}})
                intent = next((pi for pi in page.auto_paging_iter()
                               if _metadata(pi).get("top_up_id") == str(top_up.pk)), None)
        except stripe.StripeError as exc:
            error = translate(exc, "looking up a payment")
            if isinstance(error, Unavailable):
                raise StripeUnavailable(f"top-up {top_up_id}: {error.message}") from None
            log.error("top-up %s: Stripe refused to look up its lost charge: %s", top_up_id, error.message)
            TopUp.objects.filter(pk=top_up_id, status=TopUpStatus.FAILED).update(updated_at=now)
            return "error"
    if intent is None:  # the request never reached Stripe (or reached it without a customer: no charge)
        TopUp.objects.filter(pk=top_up_id, status=TopUpStatus.FAILED, outcome_unknown=True).update(
            outcome_unknown=False, failure_message="The payment provider never received the charge: your card was "
                                                   "not charged and nothing was credited.")
        log.info("top-up %s: its charge answer was lost; Stripe has no payment for it: not charged", top_up_id)
        return "not_charged"
    if intent.status in ("succeeded", *FAILED_STATUSES):
        try:
            with transaction.atomic():
                payment_intent_apply(intent=intent.to_dict(), succeeded=intent.status == "succeeded")
                known: dict[str, Any] = {"outcome_unknown": False}
                if intent.status != "succeeded":  # failed already: it now says why, for sure
                    why = payment_failure_reason(intent.to_dict())
                    known["failure_message"] = f"{why} Your card was not charged; nothing was credited."[:500]
                TopUp.objects.filter(pk=top_up_id, status=TopUpStatus.FAILED).update(**known)
        except ValueError as exc:  # cannot be read, or does not match its top-up: for operators; left as it is
            _not_applied(top_up_id, intent.id, exc)
            TopUp.objects.filter(pk=top_up_id, status=TopUpStatus.FAILED).update(updated_at=now)
            return "error"
        log.info("top-up %s: its charge answer was lost; Stripe says %s, applied", top_up_id, intent.status)
        return "succeeded" if intent.status == "succeeded" else "failed"
    with transaction.atomic():  # still under way at Stripe: followed as a processing top-up from here
        locked = TopUp.objects.select_for_update().get(pk=top_up_id)
        if locked.status == TopUpStatus.FAILED and locked.outcome_unknown:
            locked.transition_to(TopUpStatus.PROCESSING)
            locked.outcome_unknown = False
            locked.failure_message = ""
            locked.payment_intent_id = locked.payment_intent_id or intent.id
            locked.save(update_fields=["status", "outcome_unknown", "failure_message", "payment_intent_id",
                                       "updated_at"])
    return "processing"


def top_up_reconcile(*, top_up_id: int, now: datetime | None = None) -> str:
    """Look one processing top-up up at Stripe and apply the answer. Returns "succeeded", "failed", "processing"
    (left alone), "settled" (no longer processing: nothing to do) or "error" (logged; looked up again later).
    Raises StripeUnavailable when Stripe cannot be reached or failed."""
    now = now or timezone.now()
    top_up = TopUp.objects.filter(pk=top_up_id, status=TopUpStatus.PROCESSING).first()
    if top_up is None or not top_up.payment_intent_id:
        return "settled"
    try:
        intent = client().v1.payment_intents.retrieve(top_up.payment_intent_id)
    except stripe.StripeError as exc:
        error = translate(exc, "looking up a payment")
        if isinstance(error, Unavailable):
            raise StripeUnavailable(f"top-up {top_up_id}: {error.message}") from None
        log.error("top-up %s: Stripe refused to look up %s: %s", top_up_id, top_up.payment_intent_id, error.message)
        _looked_up(top_up_id, now)
        return "error"
    if intent.status not in ("succeeded", *FAILED_STATUSES):
        _looked_up(top_up_id, now)
        return "processing"
    try:
        with transaction.atomic():
            payment_intent_apply(intent=intent.to_dict(), succeeded=intent.status == "succeeded")
    except ValueError as exc:  # cannot be read, or does not match its top-up: for operators, as a failed event is
        _not_applied(top_up_id, intent.id, exc)
        _looked_up(top_up_id, now)
        return "error"
    log.info("top-up %s: no webhook came; Stripe says %s, applied", top_up_id, intent.status)
    return "succeeded" if intent.status == "succeeded" else "failed"


def _not_applied(top_up_id: int, intent_id: str, exc: ValueError) -> None:
    """Log why Stripe's answer about a top-up's payment was not applied: the top-up is left as it is (never credited
    from an amount that is not whole cents: webhooks.payment_intent_apply)."""
    if isinstance(exc, EventUnusable):
        log.error("top-up %s: Stripe's payment %s cannot be read (%s); nothing applied, the top-up is left as it is",
                  top_up_id, intent_id, exc)
    else:
        log.error("top-up %s: Stripe's payment %s does not match it (%s); nothing applied", top_up_id, intent_id,
                  exc, exc_info=exc)


def _looked_up(top_up_id: int, now: datetime) -> None:
    """Put a top-up that stays processing at the back of the queue: looked up again after the same delay."""
    TopUp.objects.filter(pk=top_up_id, status=TopUpStatus.PROCESSING).update(updated_at=now)


def refunds_reconcile(*, now: datetime | None = None, limit: int = RECONCILE_BATCH) -> Mapping[str, int | str]:
    """Settle the refunds still pending after BILLING_TOP_UP_RECONCILE_AFTER_S (their Stripe answer was lost) with
    what Stripe says; one run at a time."""
    with advisory_lock("billing.refunds_reconcile") as acquired:
        if not acquired:
            return {"skipped": "another run is reconciling refunds"}
        cutoff = (now or timezone.now()) - timedelta(seconds=settings.BILLING_TOP_UP_RECONCILE_AFTER_S)
        # The least recently looked up first: refunds whose lookup Stripe keeps refusing went first every run and
        # hid the newer ones for good.
        ids = list(Refund.objects.filter(status=RefundStatus.PENDING, created_at__lt=cutoff)
                   .order_by(F("last_tried_at").asc(nulls_first=True), "created_at", "pk")
                   .values_list("pk", flat=True)[:limit])
        return _each_until_stripe_is_away(ids, lambda pk: refund_reconcile(refund_id=pk), "refund reconcile")


def refund_reconcile(*, refund_id: int) -> str:
    """Look one pending refund up at Stripe (its top-up's refunds, by the refund id in their metadata) and apply
    the answer: "succeeded", "failed" (Stripe failed or canceled it, or made none), "pending" (Stripe has not finished
    it, pending or requires_action: made, as refund_create does), "settled"
    (no longer pending) or "error" (logged; looked up again next run). Raises StripeUnavailable."""
    refund = Refund.objects.select_related("top_up").filter(pk=refund_id, status=RefundStatus.PENDING).first()
    if refund is None:
        return "settled"
    Refund.objects.filter(pk=refund_id).update(last_tried_at=timezone.now())
    try:
        page = client().v1.refunds.list(params={"payment_intent": refund.top_up.payment_intent_id or "",
                                                "limit": 100})
        made = [r for r in page.auto_paging_iter() if _metadata(r).get("refund_id") == str(refund.pk)]
    except stripe.StripeError as exc:
        error = translate(exc, "looking up a refund")
        if isinstance(error, Unavailable):
            raise StripeUnavailable(f"refund {refund_id}: {error.message}") from None
        log.error("refund %s: Stripe refused to list the refunds of %s: %s", refund_id,
                  refund.top_up.payment_intent_id, error.message)
        # Kept with it for operators (the dashboard's money waiting on Stripe shows it), as a payout's is.
        Refund.objects.filter(pk=refund_id, status=RefundStatus.PENDING).update(
            failure_message=f"Outcome unknown; the lookup was refused: {error.message}"[:500])
        return "error"
    # Made unless Stripe failed or canceled it: succeeded, or not finished (pending, requires_action) is debited as
    # refund_create debits it, and a later failure gives the debit back (refunds.stripe_refund_apply). requires_action
    # was taken for a failure: refundable again, and the card got the money when Stripe finished it (found by
    # review).
    done = next((r for r in made if r.status not in ("failed", "canceled")), None)
    if done is not None:
        refund_confirm(refund_id=refund.pk, stripe_refund_id=done.id)
        log.info("refund %s: its answer was lost; Stripe made it (%s, %s): posted", refund_id, done.id, done.status)
        return "succeeded" if done.status == "succeeded" else "pending"
    why = (f"The payment provider says the refund {made[0].status}." if made else
           "The payment provider made no refund for it.")
    # Failed, its hold given back to the wallet (once); Stripe's failed refund's id kept with it: a late event saying
    # it was pending finds it failed, debits nothing. Settled meanwhile (its event came): that stands.
    if not refund_not_made(refund_id=refund.pk, failure_message=why, stripe_refund_id=made[0].id if made else None):
        return "settled"
    log.info("refund %s: its answer was lost; %s", refund_id, why)
    return "failed"


def _metadata(obj: Any) -> dict[str, Any]:
    """A Stripe object's metadata; {} when it has none, or none that is an object."""
    metadata = obj.to_dict().get("metadata")
    return metadata if isinstance(metadata, dict) else {}
