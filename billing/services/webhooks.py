"""Stripe webhooks: verified, stored once under the event's unique Stripe id, and acted on.

The wallet is credited by `payment_intent.succeeded`, once: the event is stored under its unique Stripe id,
and the credit's ledger key is `top-up:<id>`, so a replayed or duplicated event, or two events for one
payment, credit nothing more. A `payment_intent.payment_failed` arriving after the success (out of order)
changes nothing.
"""
import json
import logging

import stripe
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F, Q
from django.utils import timezone

from billing.models import BillingProfile, StripeEvent, StripeEventStatus, TopUp
from billing.services.stripe_gateway import MICROS_PER_CENT
from billing.services.top_ups import top_up_credit, top_up_fail

log = logging.getLogger(__name__)


class WebhookInvalid(Exception):
    """Not a genuine Stripe event (bad or missing signature, or not an event): HTTP 400."""


def webhook_receive(*, payload: bytes, signature: str | None) -> StripeEvent:
    """Verify, store once, and process a Stripe webhook delivery. Raises WebhookInvalid (400).

    Nothing is stored for a delivery whose signature does not verify. A second delivery of an event
    (same id) is counted and changes nothing else, unless the first one failed to process.
    """
    if not signature:
        raise WebhookInvalid("Missing Stripe-Signature header.")
    try:
        stripe.Webhook.construct_event(payload, signature, settings.STRIPE_WEBHOOK_SECRET)
        data = json.loads(payload)
    except stripe.SignatureVerificationError:
        raise WebhookInvalid("The signature does not verify.") from None
    except ValueError:
        raise WebhookInvalid("The body is not JSON.") from None
    if not isinstance(data, dict) or not isinstance(data.get("id"), str) or not isinstance(data.get("type"), str):
        raise WebhookInvalid("Not a Stripe event.")
    try:
        with transaction.atomic():
            event = StripeEvent.objects.create(event_id=data["id"][:100], type=data["type"][:100], payload=data)
    except IntegrityError:
        event = StripeEvent.objects.get(event_id=data["id"][:100])
        StripeEvent.objects.filter(pk=event.pk).update(deliveries=F("deliveries") + 1)
    return stripe_event_process(event_id=event.pk)


def stripe_event_process(*, event_id: int) -> StripeEvent:
    """Process a stored event unless it was already: processed and ignored events stay as they are."""
    with transaction.atomic():
        event = StripeEvent.objects.select_for_update().get(pk=event_id)
        if event.status in (StripeEventStatus.PROCESSED, StripeEventStatus.IGNORED):
            return event
        try:
            with transaction.atomic():
                handled = _handle(event.type, event.payload)
            event.status = StripeEventStatus.PROCESSED if handled else StripeEventStatus.IGNORED
            event.error = ""
        except Exception as exc:  # noqa: BLE001 (recorded on the event for operators; Stripe will retry)
            log.exception("Stripe event %s (%s) failed", event.event_id, event.type)
            event.status = StripeEventStatus.FAILED
            event.error = f"{type(exc).__name__}: {exc}"[:2000]
        event.processed_at = timezone.now()
        event.save(update_fields=["status", "error", "processed_at"])
    return event


def _top_up_of(intent: dict) -> TopUp | None:
    metadata = intent.get("metadata") or {}
    top_up_id = metadata.get("top_up_id")
    query = Q(payment_intent_id=intent.get("id"))
    if isinstance(top_up_id, str) and top_up_id.isdigit():
        query |= Q(pk=int(top_up_id))
    return TopUp.objects.filter(query).select_related("user").first()


def _handle(kind: str, payload: dict) -> bool:
    """Act on one event; False when it is not one this platform acts on."""
    if kind not in ("payment_intent.succeeded", "payment_intent.payment_failed"):
        return False
    intent = (payload.get("data") or {}).get("object") or {}
    return payment_intent_apply(intent=intent, succeeded=kind == "payment_intent.succeeded")


def payment_intent_apply(*, intent: dict, succeeded: bool) -> bool:
    """Apply what Stripe says of a top-up's PaymentIntent: credit the top-up (succeeded) or mark it failed.

    The one path for the webhook and for the follow-up of top-ups whose webhook never came
    (billing.services.reconcile): whichever comes first credits, the other changes nothing (top_up_credit
    locks the top-up and posts under the ledger key `top-up:<id>`). Call inside a transaction. False when the
    intent is no top-up's; raises ValueError when it does not match its top-up (customer, currency, amount).
    """
    top_up = _top_up_of(intent)
    if top_up is None:
        return False
    profile = BillingProfile.objects.filter(user_id=top_up.user_id).first()
    if intent.get("customer") and profile and profile.stripe_customer_id \
            and intent["customer"] != profile.stripe_customer_id:
        raise ValueError(f"payment intent {intent.get('id')} is not of top-up {top_up.pk}'s customer")
    if succeeded:
        if intent.get("currency") != "usd":
            raise ValueError(f"payment intent {intent.get('id')} is in {intent.get('currency')}, not usd")
        top_up_credit(top_up_id=top_up.pk, payment_intent_id=intent["id"],
                      amount_micros=int(intent["amount"]) * MICROS_PER_CENT)
        return True
    error = intent.get("last_payment_error") or {}
    reason = error.get("message") or ("The payment was canceled." if intent.get("status") == "canceled"
                                      else "The payment failed.")
    top_up_fail(top_up, reason, payment_intent_id=intent.get("id"), notify=True)
    return True
