"""Billing events users can read in the API (GET /api/v1/billing/events/), some also sent by email."""
import logging
from typing import Any

from django.conf import settings
from django.core.mail import send_mail
from django.db import transaction

from billing.models import BillingEvent
from marketplace.models import User

log = logging.getLogger(__name__)

SUBJECTS = {
    "low_balance": "Your balance is running low",
    "balance_depleted": "Your balance reached zero: your instances were stopped",
    "destroy_warning": "Your stopped instances will be destroyed soon",
    "instances_destroyed": "Your stopped instances were destroyed",
    "top_up_failed": "Your top-up failed",
    "chargeback": "A disputed card payment was debited from your balance",
    "chargeback_reversed": "A disputed card payment is back in your balance",
    "payout_failed": "Your payout failed",
    "instance_interrupted": "Your instance was interrupted: billing stopped",
    "instance_resumed": "Your instance is running again",
    "instance_lost": "Your instance was lost with its server",
    "service_credit": "A service credit was charged to your earnings",
    "price_cut": "Your instance's price was cut: its server measured worse",
    "price_raised_back": "Your instance's price went back up: its server measured better again",
}


def event_create(*, user: User, kind: str, message: str, data: dict[str, Any] | None = None,
                 email: bool = False) -> BillingEvent:
    """Record the event; with `email`, send it to the user once the caller's transaction commits."""
    event = BillingEvent.objects.create(user=user, kind=kind, message=message, data=data or {}, emailed=email)
    if email and user.email:
        transaction.on_commit(lambda: _send(user.email, kind, message))
    return event


def _send(address: str, kind: str, message: str) -> None:
    subject = f"[{settings.PLATFORM_NAME}] {SUBJECTS.get(kind, 'Billing')}"
    try:
        send_mail(subject, message, settings.DEFAULT_FROM_EMAIL, [address])
    except Exception:  # noqa: BLE001 (a mail server outage must not undo billing)
        log.exception("could not email %s about %s", address, kind)
