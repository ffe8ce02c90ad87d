"""Saved cards: a SetupIntent to start saving one, saving it (attached to the user's Stripe customer),
and forgetting it."""
import logging
import re

import stripe
from django.conf import settings
from django.db import IntegrityError, transaction

from billing.models import BillingProfile, Card
from billing.services.customers import customer_for
from billing.services.stripe_gateway import client, translate
from core.errors import ValidationFailed
from marketplace.models import User

log = logging.getLogger(__name__)

# The shapes of Stripe's ids, checked here; the API's schema publishes the same patterns, the card form uses them.
PAYMENT_METHOD_ID = r"^pm_[A-Za-z0-9_]{1,95}$"
SETUP_INTENT_ID = r"^seti_[A-Za-z0-9_]{1,95}$"
_PM_RE = re.compile(PAYMENT_METHOD_ID)
_SETI_RE = re.compile(SETUP_INTENT_ID)


def setup_intent_create(*, user: User) -> dict[str, str | None]:
    """Start saving a card: a SetupIntent whose client_secret the browser confirms with Stripe.js.

    Then POST its id (or the resulting payment method id) to /api/v1/billing/cards/.
    """
    customer = customer_for(user=user, verify=True)
    try:
        # `payment_method_types`: the name localstripe (tests, demo) knows; Stripe's API of stripe 16 calls it
        # `allowed_payment_method_types`, hence the params are not its typed dict.
        intent = client().v1.setup_intents.create(params={  # type: ignore[arg-type]
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
        raise ValidationFailed("Give either `payment_method` or `setup_intent`.", field="payment_method")
    if payment_method and not _PM_RE.fullmatch(payment_method):
        raise ValidationFailed("A payment method id looks like pm_...", field="payment_method")
    if setup_intent and not _SETI_RE.fullmatch(setup_intent):
        raise ValidationFailed("A SetupIntent id looks like seti_...", field="setup_intent")
    customer = customer_for(user=user, verify=not setup_intent)
    api = client().v1
    try:
        if setup_intent:
            intent = api.setup_intents.retrieve(setup_intent)
            if intent.customer != customer:
                raise ValidationFailed("This SetupIntent is not yours.", field="setup_intent")
            if intent.status != "succeeded" or not intent.payment_method:
                raise ValidationFailed(f"This SetupIntent is {intent.status}; confirm it with the card first.",
                                     field="setup_intent")
            payment_method = intent.payment_method if isinstance(intent.payment_method, str) \
                else intent.payment_method.id
        method = api.payment_methods.retrieve(payment_method)
        if method.type != "card":
            raise ValidationFailed("Only cards can be saved.", field="payment_method")
        if method.customer and method.customer != customer:
            raise ValidationFailed("This payment method belongs to someone else.", field="payment_method")
        if not method.customer:
            method = api.payment_methods.attach(method.id, params={"customer": customer})
    except stripe.InvalidRequestError as exc:
        if exc.http_status == 404:
            field = "setup_intent" if setup_intent and not payment_method else "payment_method"
            raise ValidationFailed("No such payment method or SetupIntent at the payment provider.",
                                 field=field) from None
        raise translate(exc, "saving your card") from None
    except stripe.StripeError as exc:
        raise translate(exc, "saving your card") from None
    card = method.card
    assert card is not None  # a payment method of type "card" (checked above) has its card
    try:
        with transaction.atomic():
            return Card.objects.create(
                user=user, stripe_payment_method_id=method.id, brand=card.brand or "", last4=card.last4 or "",
                exp_month=card.exp_month, exp_year=card.exp_year,
            ), True
    except IntegrityError:
        existing = Card.objects.get(stripe_payment_method_id=method.id)
        if existing.user_id != user.pk:
            raise ValidationFailed("This payment method belongs to someone else.", field="payment_method") from None
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
