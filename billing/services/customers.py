"""Stripe customers and billing profiles: one BillingProfile per user, holding the Stripe customer id
(created at Stripe on first use) and the auto top-up settings."""
import logging

import stripe
from django.db import transaction

from billing.models import BillingProfile, Card
from billing.services.stripe_gateway import client, translate
from marketplace.models import User

log = logging.getLogger(__name__)


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
    assert profile.stripe_customer_id  # ours, or the one a concurrent first request stored
    return profile.stripe_customer_id
