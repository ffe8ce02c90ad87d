"""Billing events users can read in the API (GET /api/v1/billing/events/), some also sent by email."""
import logging
from typing import Any

from django.conf import settings
from django.core.mail import EmailMessage
from django.db import transaction

from billing.models import BillingEvent, EventKind
from marketplace.models import User
from notifications.services.notify import Kind, email_wanted
from notifications.services.unsubscribe import kind_label, unsubscribe_headers

log = logging.getLogger(__name__)

SUBJECTS = {
    "low_balance": "Your balance is running low",
    "balance_depleted": "Your balance reached zero: your instances were stopped",
    "destroy_warning": "Your stopped or failed instances and your volumes will be destroyed soon",
    "instances_destroyed": "Your stopped or failed instances or your volumes were destroyed",
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
    "volume_not_deleted": "Your volume was not deleted: its server refused, and it is billed again",
}


# The notification preference whose e-mail channel decides whether each event kind is e-mailed: the kind of the
# notice told of the same event where there is one (an instance resumed to `starting` as one resumed to `running`,
# whose notice is INSTANCE_RUNNING), else the billing notices' own. Before, every `email=True` event was sent
# whatever the user chose (found by review). Every EventKind is listed (tests/notifications/test_round47_*).
EMAIL_PREFERENCE: dict[str, str] = {
    EventKind.LOW_BALANCE: Kind.LOW_BALANCE,
    EventKind.CREDIT: Kind.CREDIT_POSTED,
    EventKind.CREDIT_REVERSED: Kind.CREDIT_REVERSED,
    EventKind.PAYOUT_PAID: Kind.PAYOUT_SENT,
    EventKind.INSTANCE_INTERRUPTED: Kind.INSTANCE_INTERRUPTED,
    EventKind.INSTANCE_RESUMED: Kind.INSTANCE_RUNNING,
    EventKind.INSTANCE_LOST: Kind.INSTANCE_FAILED,
    **{kind: Kind.BILLING_NOTICE for kind in (
        EventKind.BALANCE_DEPLETED, EventKind.DESTROY_WARNING, EventKind.INSTANCES_DESTROYED,
        EventKind.TOP_UP_SUCCEEDED, EventKind.TOP_UP_FAILED, EventKind.REFUND, EventKind.CHARGEBACK,
        EventKind.CHARGEBACK_REVERSED, EventKind.PAYOUT_FAILED, EventKind.SERVICE_CREDIT, EventKind.PRICE_CUT,
        EventKind.PRICE_RAISED_BACK, EventKind.VOLUME_NOT_DELETED)},
}


# E-mailed whatever the preferences say: the last warning before a renter's instances and disks are destroyed for
# an unpaid balance. Data lost cannot be brought back; a renter who turned billing notices off still gets this one
# (as a cloud's notice of a deletion goes to every account, whatever its marketing or notice settings).
ALWAYS_EMAILED = frozenset({EventKind.DESTROY_WARNING})


def event_create(*, user: User, kind: str, message: str, data: dict[str, Any] | None = None,
                 email: bool = False) -> BillingEvent:
    """Record the event; with `email`, send it to the user once the caller's transaction commits, if the
    preference that covers its kind (EMAIL_PREFERENCE) has e-mail on, or always (ALWAYS_EMAILED). `emailed`:
    whether it is e-mailed."""
    if email and kind in ALWAYS_EMAILED:
        email = bool(user.email)
    else:
        email = email and email_wanted(user=user, kind=EMAIL_PREFERENCE.get(kind, Kind.BILLING_NOTICE))
    event = BillingEvent.objects.create(user=user, kind=kind, message=message, data=data or {}, emailed=email)
    if email:
        # One that the user may turn off carries its preference's one-click unsubscribe, as the notices' e-mails do
        # (notifications.services.unsubscribe); the always-sent warning none, as turning it off would not stop it.
        preference = EMAIL_PREFERENCE.get(kind, Kind.BILLING_NOTICE)
        headers = {} if kind in ALWAYS_EMAILED else unsubscribe_headers(user=user, kind=preference)
        text = message
        if headers:
            text += (f"\n\nTo stop e-mails of this kind (\"{kind_label(preference)}\"), open "
                     f"{headers['List-Unsubscribe'][1:-1]}")
        transaction.on_commit(lambda: _send(user.email, kind, text, headers))
    return event


def _send(address: str, kind: str, message: str, headers: dict[str, str]) -> None:
    subject = f"[{settings.PLATFORM_NAME}] {SUBJECTS.get(kind, 'Billing')}"
    try:
        EmailMessage(subject, message, settings.DEFAULT_FROM_EMAIL, [address], headers=headers).send()
    except Exception:  # noqa: BLE001 (a mail server outage must not undo billing)
        log.exception("could not email %s about %s", address, kind)
