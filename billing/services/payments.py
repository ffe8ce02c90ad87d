"""Money coming in and going back: Stripe customers, saved cards, top-ups, webhooks, refunds.

A top-up is recorded first (status `pending`, committed), then charged with a PaymentIntent outside any
database transaction, then marked `processing` (Stripe took the money) or `failed` (declined, or Stripe
unreachable). The wallet is credited only by the `payment_intent.succeeded` webhook, once: the event is
stored under its unique Stripe id, and the credit's ledger key is `top-up:<id>`, so a replayed or
duplicated event, or two events for one payment, credit nothing more. A `payment_intent.payment_failed`
arriving after the success (out of order) changes nothing.

A refund reserves its amount (a `pending` Refund, under a lock on the top-up and the wallet), calls
Stripe, and on success posts the reversal (wallet → payment clearing) keyed by the Stripe refund id.
"""
import hashlib
import json
import logging
import re
import uuid
from datetime import timedelta
from decimal import Decimal

import stripe
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F, Q, Sum
from django.utils import timezone

from billing.models import (
    Account,
    AccountKind,
    BillingProfile,
    Card,
    EventKind,
    Refund,
    RefundStatus,
    StripeEvent,
    StripeEventStatus,
    TopUp,
    TopUpStatus,
    TransactionKind,
)
from billing.services.ledger import ledger_post, platform_account, user_account
from billing.services.notify import event_create
from billing.services.stripe_gateway import (
    MICROS_PER_CENT,
    PaymentConflict,
    PaymentDeclined,
    PaymentError,
    PaymentIdempotencyKeyReused,
    PaymentInvalid,
    PaymentProviderUnavailable,
    cents,
    client,
    is_definite,
    translate,
)
from marketplace.models import User
from marketplace.money import micros_to_usd, usd_to_micros

log = logging.getLogger(__name__)

_PM_RE = re.compile(r"pm_[A-Za-z0-9_]{1,95}")
_SETI_RE = re.compile(r"seti_[A-Za-z0-9_]{1,95}")


class WebhookInvalid(Exception):
    """Not a genuine Stripe event (bad or missing signature, or not an event): HTTP 400."""


# ----------------------------------------------------------------------------------- customers


def profile_for(*, user: User) -> BillingProfile:
    profile, _ = BillingProfile.objects.get_or_create(user=user)
    return profile


def customer_for(*, user: User, verify: bool = False) -> str:
    """The user's Stripe customer id, created at Stripe on first use (outside any transaction).

    `verify`: check that Stripe still knows it (it may not after a switch of Stripe account, or with a
    fresh localstripe in the demo); a customer Stripe lost is forgotten here with the cards saved on it.
    """
    profile = profile_for(user=user)
    if profile.stripe_customer_id and verify:
        try:
            found = client().v1.customers.retrieve(profile.stripe_customer_id)
            gone = bool(getattr(found, "deleted", False))
        except stripe.InvalidRequestError as exc:
            if exc.http_status != 404:
                raise translate(exc, "looking up your payment account") from None
            gone = True
        except stripe.StripeError as exc:
            raise translate(exc, "looking up your payment account") from None
        if gone:
            log.warning("Stripe no longer knows customer %s of user %s: making a new one",
                        profile.stripe_customer_id, user.pk)
            with transaction.atomic():
                BillingProfile.objects.filter(pk=profile.pk, stripe_customer_id=profile.stripe_customer_id).update(
                    stripe_customer_id=None, auto_top_up_enabled=False, auto_top_up_card=None)
                Card.objects.filter(user=user).delete()
            profile.refresh_from_db()
    if profile.stripe_customer_id:
        return profile.stripe_customer_id
    try:
        customer = client().v1.customers.create(params={"email": user.email, "metadata": {"user_id": str(user.pk)}})
    except stripe.StripeError as exc:
        raise translate(exc, "setting up your payment account") from None
    # Two first requests at once make two customers at Stripe; the first one stored wins (the other is unused).
    BillingProfile.objects.filter(pk=profile.pk, stripe_customer_id__isnull=True).update(
        stripe_customer_id=customer.id)
    profile.refresh_from_db(fields=["stripe_customer_id"])
    return profile.stripe_customer_id


# ---------------------------------------------------------------------------------------- cards


def setup_intent_create(*, user: User) -> dict:
    """Start saving a card: a SetupIntent whose client_secret the browser confirms with Stripe.js.

    Then POST its id (or the resulting payment method id) to /api/v1/billing/cards/.
    """
    customer = customer_for(user=user, verify=True)
    try:
        intent = client().v1.setup_intents.create(params={
            "customer": customer, "payment_method_types": ["card"], "usage": "off_session",
            "metadata": {"user_id": str(user.pk)},
        })
    except stripe.StripeError as exc:
        raise translate(exc, "starting to save a card") from None
    return {"setup_intent": intent.id, "client_secret": intent.client_secret,
            "publishable_key": settings.STRIPE_PUBLISHABLE_KEY}


def card_add(*, user: User, payment_method: str = "", setup_intent: str = "") -> tuple[Card, bool]:
    """Save a card: a confirmed SetupIntent of the user's, or a payment method id from Stripe.js.

    The payment method is attached to the user's Stripe customer (Stripe may decline the card here).
    Returns (card, created); the same card again is (that card, False).
    """
    if bool(payment_method) == bool(setup_intent):
        raise PaymentInvalid("Give either `payment_method` or `setup_intent`.", field="payment_method")
    if payment_method and not _PM_RE.fullmatch(payment_method):
        raise PaymentInvalid("A payment method id looks like pm_...", field="payment_method")
    if setup_intent and not _SETI_RE.fullmatch(setup_intent):
        raise PaymentInvalid("A SetupIntent id looks like seti_...", field="setup_intent")
    customer = customer_for(user=user, verify=not setup_intent)
    api = client().v1
    try:
        if setup_intent:
            intent = api.setup_intents.retrieve(setup_intent)
            if intent.customer != customer:
                raise PaymentInvalid("This SetupIntent is not yours.", field="setup_intent")
            if intent.status != "succeeded" or not intent.payment_method:
                raise PaymentInvalid(f"This SetupIntent is {intent.status}; confirm it with the card first.",
                                     field="setup_intent")
            payment_method = intent.payment_method if isinstance(intent.payment_method, str) \
                else intent.payment_method.id
        method = api.payment_methods.retrieve(payment_method)
        if method.type != "card":
            raise PaymentInvalid("Only cards can be saved.", field="payment_method")
        if method.customer and method.customer != customer:
            raise PaymentInvalid("This payment method belongs to someone else.", field="payment_method")
        if not method.customer:
            method = api.payment_methods.attach(method.id, params={"customer": customer})
    except stripe.InvalidRequestError as exc:
        if exc.http_status == 404:
            field = "setup_intent" if setup_intent and not payment_method else "payment_method"
            raise PaymentInvalid("No such payment method or SetupIntent at the payment provider.",
                                 field=field) from None
        raise translate(exc, "saving your card") from None
    except stripe.StripeError as exc:
        raise translate(exc, "saving your card") from None
    card = method.card
    try:
        with transaction.atomic():
            return Card.objects.create(
                user=user, stripe_payment_method_id=method.id, brand=card.brand or "", last4=card.last4 or "",
                exp_month=card.exp_month, exp_year=card.exp_year,
            ), True
    except IntegrityError:
        existing = Card.objects.get(stripe_payment_method_id=method.id)
        if existing.user_id != user.pk:
            raise PaymentInvalid("This payment method belongs to someone else.", field="payment_method") from None
        return existing, False


def card_remove(*, card: Card) -> None:
    """Forget a card here and detach it at Stripe (a failure to detach is logged, not fatal)."""
    payment_method = card.stripe_payment_method_id
    with transaction.atomic():
        BillingProfile.objects.filter(auto_top_up_card=card).update(auto_top_up_enabled=False, auto_top_up_card=None)
        card.delete()
    try:
        client().v1.payment_methods.detach(payment_method)
    except stripe.StripeError:
        log.warning("could not detach %s at Stripe", payment_method, exc_info=True)


# ------------------------------------------------------------------------------------- top-ups


def top_up_bounds() -> tuple[int, int]:
    return (usd_to_micros(Decimal(settings.BILLING_TOP_UP_MIN_USD)),
            usd_to_micros(Decimal(settings.BILLING_TOP_UP_MAX_USD)))


def request_fingerprint(data) -> str:
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def top_up_for_idempotency_key(*, user: User, idempotency_key: str, request_fingerprint: str) -> TopUp | None:
    existing = TopUp.objects.filter(user=user, idempotency_key=idempotency_key).first()
    if existing is not None and existing.request_fingerprint != request_fingerprint:
        raise PaymentIdempotencyKeyReused(
            f"This Idempotency-Key was already used for a different top-up ({existing.pk}). "
            "Send the same body to get that top-up again, or use a new key."
        )
    return existing


def top_up_create(*, user: User, amount_micros: int, card: Card, idempotency_key: str = "",
                  request_fingerprint: str = "") -> tuple[TopUp, bool]:
    """Charge a saved card and return the top-up (`processing`: the credit follows with Stripe's webhook).

    Returns (top_up, created): an Idempotency-Key seen before returns that top-up without charging again.
    Raises PaymentInvalid (400), PaymentDeclined (402, recorded as failed), PaymentProviderUnavailable (503)
    or PaymentProviderRefused (502); in each case nothing was credited.
    """
    low, high = top_up_bounds()
    if type(amount_micros) is not int or not low <= amount_micros <= high:
        raise PaymentInvalid(f"Top up between ${micros_to_usd(low)} and ${micros_to_usd(high)}.", field="amount")
    if amount_micros % MICROS_PER_CENT:
        raise PaymentInvalid("Amounts are in whole cents.", field="amount")
    if card.user_id != user.pk:
        raise PaymentInvalid("No such card.", field="card")
    if idempotency_key:
        existing = top_up_for_idempotency_key(user=user, idempotency_key=idempotency_key,
                                              request_fingerprint=request_fingerprint)
        if existing is not None:
            return existing, False
    try:
        with transaction.atomic():
            top_up = TopUp.objects.create(
                user=user, amount_micros=amount_micros, card=card, card_label=str(card),
                idempotency_key=idempotency_key, request_fingerprint=request_fingerprint if idempotency_key else "",
            )
    except IntegrityError:  # a concurrent request with the same key won
        existing = top_up_for_idempotency_key(user=user, idempotency_key=idempotency_key,
                                              request_fingerprint=request_fingerprint)
        if existing is None:
            raise
        return existing, False
    return top_up_charge(top_up=top_up), True


def top_up_charge(*, top_up: TopUp) -> TopUp:
    """Charge a pending top-up's card off-session (outside any transaction) and record Stripe's answer."""
    if top_up.status != TopUpStatus.PENDING or top_up.card is None:
        return top_up
    user = top_up.user
    try:
        customer = customer_for(user=user)
        intent = client().v1.payment_intents.create(
            params={
                "amount": cents(top_up.amount_micros), "currency": "usd", "customer": customer,
                "payment_method": top_up.card.stripe_payment_method_id, "off_session": True, "confirm": True,
                "payment_method_types": ["card"],
                "metadata": {"top_up_id": str(top_up.pk), "user_id": str(user.pk)},
            },
            options={"idempotency_key": f"top-up-{top_up.pk}"},
        )
    except PaymentError as exc:  # from customer_for
        _top_up_failed(top_up, exc.message, notify=False)
        exc.top_up = top_up.pk
        raise
    except stripe.StripeError as exc:
        error = translate(exc, "charging your card")
        payment_intent = getattr(getattr(exc, "error", None), "payment_intent", None)
        _top_up_failed(top_up, error.message, payment_intent_id=getattr(payment_intent, "id", None),
                       notify=isinstance(error, PaymentDeclined))
        if not is_definite(exc):
            log.warning("top-up %s: outcome unknown (%s); a webhook will credit it if Stripe charged", top_up.pk, exc)
        error.top_up = top_up.pk
        raise error from None
    if intent.status in ("succeeded", "processing", "requires_capture"):
        with transaction.atomic():
            top_up = TopUp.objects.select_for_update().get(pk=top_up.pk)
            if top_up.payment_intent_id is None:
                top_up.payment_intent_id = intent.id
            if top_up.status == TopUpStatus.PENDING:  # the webhook may have been faster
                top_up.status = TopUpStatus.PROCESSING
            top_up.save(update_fields=["payment_intent_id", "status", "updated_at"])
        return top_up
    message = ("Your bank asks for authentication, which a saved card cannot give off-session; "
               "use another card." if intent.status == "requires_action" else f"The payment is {intent.status}.")
    _top_up_failed(top_up, message, payment_intent_id=intent.id, notify=True)
    error = PaymentDeclined(message + " Nothing was credited.")
    error.top_up = top_up.pk
    raise error


def _top_up_failed(top_up: TopUp, message: str, *, payment_intent_id: str | None = None, notify: bool) -> None:
    with transaction.atomic():
        locked = TopUp.objects.select_for_update().get(pk=top_up.pk)
        if locked.status in (TopUpStatus.PENDING, TopUpStatus.PROCESSING):
            locked.status = TopUpStatus.FAILED
            locked.failure_message = message[:500]
            if payment_intent_id and locked.payment_intent_id is None:
                locked.payment_intent_id = payment_intent_id
            locked.save(update_fields=["status", "failure_message", "payment_intent_id", "updated_at"])
            if notify:
                event_create(user=locked.user, kind=EventKind.TOP_UP_FAILED,
                             message=f"Your top-up of ${micros_to_usd(locked.amount_micros)} failed: {message}",
                             data={"top_up": locked.pk}, email=locked.automatic)
        top_up.refresh_from_db()


def top_up_credit(*, top_up_id: int, payment_intent_id: str, amount_micros: int) -> bool:
    """Credit the wallet for a top-up Stripe says succeeded. Once per top-up; False if it was already.

    Call inside a transaction (the webhook's). A top-up that failed here (Stripe unreachable) but was
    charged after all is credited too: the money arrived.
    """
    top_up = TopUp.objects.select_for_update().get(pk=top_up_id)
    if top_up.status == TopUpStatus.SUCCEEDED:
        return False
    if amount_micros != top_up.amount_micros:
        raise ValueError(f"top-up {top_up.pk} is for {top_up.amount_micros} µ$, Stripe charged {amount_micros} µ$")
    txn, _ = ledger_post(
        idempotency_key=f"top-up:{top_up.pk}", kind=TransactionKind.TOP_UP,
        lines=[(user_account(user_id=top_up.user_id, kind=AccountKind.CUSTOMER_WALLET), amount_micros),
               (platform_account(AccountKind.PAYMENT_CLEARING), -amount_micros)],
        memo=f"Top-up {top_up.pk} ({payment_intent_id})",
    )
    top_up.status = TopUpStatus.SUCCEEDED
    top_up.failure_message = ""
    top_up.transaction = txn
    top_up.payment_intent_id = top_up.payment_intent_id or payment_intent_id
    top_up.credited_at = timezone.now()
    top_up.save(update_fields=["status", "failure_message", "transaction", "payment_intent_id", "credited_at",
                               "updated_at"])
    event_create(user=top_up.user, kind=EventKind.TOP_UP_SUCCEEDED,
                 message=f"${micros_to_usd(amount_micros)} was added to your balance.",
                 data={"top_up": top_up.pk, "amount": str(micros_to_usd(amount_micros))})
    return True


# ------------------------------------------------------------------------------------- webhooks


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
    top_up = _top_up_of(intent)
    if top_up is None:
        return False
    profile = BillingProfile.objects.filter(user_id=top_up.user_id).first()
    if intent.get("customer") and profile and profile.stripe_customer_id \
            and intent["customer"] != profile.stripe_customer_id:
        raise ValueError(f"payment intent {intent.get('id')} is not of top-up {top_up.pk}'s customer")
    if kind == "payment_intent.succeeded":
        if intent.get("currency") != "usd":
            raise ValueError(f"payment intent {intent.get('id')} is in {intent.get('currency')}, not usd")
        top_up_credit(top_up_id=top_up.pk, payment_intent_id=intent["id"],
                      amount_micros=int(intent["amount"]) * MICROS_PER_CENT)
        return True
    error = intent.get("last_payment_error") or {}
    _top_up_failed(top_up, error.get("message") or "The payment failed.", payment_intent_id=intent.get("id"),
                   notify=True)
    return True


# --------------------------------------------------------------------------------------- refunds


def refundable_micros(*, top_up: TopUp) -> int:
    if top_up.status != TopUpStatus.SUCCEEDED:
        return 0
    taken = top_up.refunds.filter(status__in=[RefundStatus.PENDING, RefundStatus.SUCCEEDED]).aggregate(
        total=Sum("amount_micros"))["total"] or 0
    return top_up.amount_micros - taken


def refund_create(*, top_up: TopUp, amount_micros: int, reason: str, created_by: User) -> Refund:
    """Give (part of) a top-up back to its card and debit the wallet. Operators only.

    The amount is reserved first (a pending refund, under locks on the top-up and the wallet), so that
    two refunds at once cannot give back more than was paid, or more than the customer has left.
    """
    if type(amount_micros) is not int or amount_micros <= 0 or amount_micros % MICROS_PER_CENT:
        raise PaymentInvalid("Refund a positive amount in whole cents.", field="amount")
    if not reason.strip():
        raise PaymentInvalid("Give a reason.", field="reason")
    with transaction.atomic():
        top_up = TopUp.objects.select_for_update().get(pk=top_up.pk)
        if top_up.status != TopUpStatus.SUCCEEDED or not top_up.payment_intent_id:
            raise PaymentConflict(f"Only a credited top-up can be refunded; this one is {top_up.status}.")
        left = refundable_micros(top_up=top_up)
        if amount_micros > left:
            raise PaymentConflict(f"At most ${micros_to_usd(left)} of this top-up can still be refunded.")
        wallet = user_account(user_id=top_up.user_id, kind=AccountKind.CUSTOMER_WALLET)
        wallet = Account.objects.select_for_update().get(pk=wallet.pk)
        reserved = Refund.objects.filter(top_up__user_id=top_up.user_id, status=RefundStatus.PENDING).aggregate(
            total=Sum("amount_micros"))["total"] or 0
        if amount_micros > wallet.balance_micros - reserved:
            raise PaymentConflict(
                f"The customer's balance is ${micros_to_usd(wallet.balance_micros - reserved)}: the rest was spent. "
                "Refund at most that much."
            )
        refund = Refund.objects.create(top_up=top_up, amount_micros=amount_micros, reason=reason,
                                       created_by=created_by)
    try:
        answer = client().v1.refunds.create(
            params={"payment_intent": top_up.payment_intent_id, "amount": cents(amount_micros),
                    "metadata": {"refund_id": str(refund.pk), "top_up_id": str(top_up.pk)}},
            options={"idempotency_key": f"refund-{refund.pk}"},
        )
    except stripe.StripeError as exc:
        error = translate(exc, "refunding the card")
        Refund.objects.filter(pk=refund.pk, status=RefundStatus.PENDING).update(
            status=RefundStatus.FAILED, failure_message=error.message[:500])
        raise error from None
    if answer.status in ("failed", "canceled"):
        Refund.objects.filter(pk=refund.pk, status=RefundStatus.PENDING).update(
            status=RefundStatus.FAILED, failure_message=f"The payment provider says the refund {answer.status}.")
        raise PaymentConflict(f"The payment provider says the refund {answer.status}; nothing was debited.")
    return refund_confirm(refund_id=refund.pk, stripe_refund_id=answer.id)


def refund_confirm(*, refund_id: int, stripe_refund_id: str) -> Refund:
    """Post the refund's reversal (wallet → payment clearing), once: idempotent on the Stripe refund id."""
    with transaction.atomic():
        refund = Refund.objects.select_for_update().select_related("top_up__user").get(pk=refund_id)
        if refund.status == RefundStatus.SUCCEEDED:
            return refund
        top_up = refund.top_up
        txn, _ = ledger_post(
            idempotency_key=f"refund:{stripe_refund_id}", kind=TransactionKind.REFUND,
            lines=[(user_account(user_id=top_up.user_id, kind=AccountKind.CUSTOMER_WALLET), -refund.amount_micros),
                   (platform_account(AccountKind.PAYMENT_CLEARING), refund.amount_micros)],
            memo=f"Refund {refund.pk} of top-up {top_up.pk} ({stripe_refund_id})", reason=refund.reason,
            created_by=refund.created_by,
        )
        refund.status = RefundStatus.SUCCEEDED
        refund.stripe_refund_id = stripe_refund_id
        refund.transaction = txn
        refund.failure_message = ""
        refund.save(update_fields=["status", "stripe_refund_id", "transaction", "failure_message"])
        event_create(user=top_up.user, kind=EventKind.REFUND,
                     message=f"${micros_to_usd(refund.amount_micros)} of your top-up {top_up.pk} was refunded to "
                             f"your card: {refund.reason}",
                     data={"top_up": top_up.pk, "refund": refund.pk,
                           "amount": str(micros_to_usd(refund.amount_micros))})
    return refund


# ----------------------------------------------------------------------------------- auto top-up


def auto_top_up_start(*, user_id: int) -> TopUp | None:
    """Start an automatic top-up for a user below their threshold, unless one is under way already.

    Called by the meter tick; the charge itself runs in a task (billing.tasks.top_up_charge).
    """
    from billing.services.ledger import wallet_balance

    with transaction.atomic():
        profile = BillingProfile.objects.select_for_update().filter(user_id=user_id).first()
        if profile is None or not profile.auto_top_up_enabled or profile.auto_top_up_card_id is None:
            return None
        if wallet_balance(user_id=user_id) >= profile.auto_top_up_threshold_micros:
            return None
        in_flight = TopUp.objects.filter(
            user_id=user_id, automatic=True,
            status__in=[TopUpStatus.PENDING, TopUpStatus.PROCESSING],
            created_at__gte=timezone.now() - timedelta(hours=1),
        ).exists()
        if in_flight:
            return None
        top_up = TopUp.objects.create(
            user_id=user_id, amount_micros=profile.auto_top_up_amount_micros, card_id=profile.auto_top_up_card_id,
            card_label=str(profile.auto_top_up_card), automatic=True, idempotency_key=f"auto-{uuid.uuid4()}",
        )

        def queue():
            from billing import tasks  # tasks import services: import at call time, layers stay one-way

            tasks.top_up_charge.delay(top_up.pk)

        transaction.on_commit(queue)
    return top_up


def top_up_charge_by_id(*, top_up_id: int) -> None:
    top_up = TopUp.objects.select_related("user", "card").filter(pk=top_up_id).first()
    if top_up is None or top_up.status != TopUpStatus.PENDING:
        return
    try:
        top_up_charge(top_up=top_up)
    except PaymentError as exc:
        log.info("automatic top-up %s failed: %s", top_up_id, exc.message)


__all__ = [
    "PaymentConflict",
    "PaymentDeclined",
    "PaymentError",
    "PaymentInvalid",
    "PaymentProviderUnavailable",
    "WebhookInvalid",
]
