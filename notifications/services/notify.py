"""The one way into notifications: `notify(user=..., kind=..., payload=..., dedupe_key=...)`.

Called by the other apps' services where the event really happens, inside their transaction: the notice is
written with the state change (or not at all, if that rolls back), once per (user, dedupe_key) as the unique
constraint decides, and its e-mail and webhook deliveries are queued when the transaction commits. A broker that
refuses them is logged; the beat's resenders queue them again: `deliveries_resend` the webhook deliveries,
`emails_resend` the e-mails (pending, notifications/services/email.py).
"""
import hashlib
import json
import logging
from collections import defaultdict
from decimal import Decimal, InvalidOperation
from typing import Any

from django.db import IntegrityError, connection, transaction
from django.db.models import QuerySet
from django.utils import timezone

from core import dispatch
from core.errors import ValidationFailed
from core.money import usd_text, usd_to_micros
from marketplace.models import User
from notifications.models import (
    EMAIL_ONLY_KINDS,
    PREFERENCE_KINDS,
    EmailStatus,
    Kind,
    Notification,
    Preference,
    WebhookDelivery,
    WebhookEndpoint,
    kinds_readable,
    roles_readable,
)

log = logging.getLogger(__name__)

EMAIL_SEND = dispatch.task_name("notifications.tasks.email_send")
WEBHOOK_DELIVER = dispatch.task_name("notifications.tasks.webhook_deliver")

# Titles, filled from the payload (a missing member reads "?").
TITLES = {
    Kind.LOW_BALANCE: "Your balance is running low",
    Kind.INSTANCE_RUNNING: "Instance {instance} is running",
    Kind.INSTANCE_STOPPED: "Instance {instance} stopped",
    Kind.INSTANCE_FAILED: "Instance {instance} failed",
    Kind.INSTANCE_INTERRUPTED: "Instance {instance} was interrupted",
    Kind.INSTANCE_STOPPED_BY_OPERATOR: "Instance {instance} was stopped by the operators",
    Kind.INSTANCE_DESTROYED_BY_OPERATOR: "Instance {instance} was destroyed by the operators",
    Kind.VOLUME_LOST: "Volume {name} was lost with its server",
    Kind.NODE_OFFLINE: "Node {node} is offline",
    Kind.NODE_REJECTED: "Node {node} did not pass the benchmark check",
    Kind.NODE_DEGRADED: "Node {node} is listed as degraded",
    Kind.NODE_MIG_LAYOUT_DUE: "Node {node}: GPU {gpu} is free, configure its declared MIG layout",
    Kind.NODE_CHANGED_BY_OPERATOR: "Node {name} was {done} by the operators",
    Kind.PAYOUT_SENT: "Payout {payout} sent: {amount_text}",
    Kind.CREDIT_POSTED: "{amount_text} was credited to your balance",
    Kind.CREDIT_REVERSED: "A credit of {amount_text} was reversed",
    Kind.ACCOUNT_DEACTIVATED: "Your account was deactivated",
    Kind.ACCOUNT_REACTIVATED: "Your account is active again",
    Kind.WEBHOOK_ENDPOINT_DISABLED: "Webhook endpoint {endpoint} was paused: it failed for days",
    Kind.TEST: "Test event",
}


def _title(kind: str, payload: dict[str, Any]) -> str:
    values: defaultdict[str, Any] = defaultdict(lambda: "?", payload)
    values["amount_text"] = _amount_text(payload.get("amount"))
    return TITLES[Kind(kind)].format_map(values)[:200]


def _amount_text(amount: Any) -> str:
    """The payload's exact USD amount ("5.000000": the API's and webhooks' figure) as a title reads money, as the
    messages do ("$5.00"; before, titles read "5.000000 USD")."""
    try:
        return usd_text(usd_to_micros(Decimal(str(amount))))
    except (InvalidOperation, ValueError, TypeError):
        return "?"


DEDUPE_KEY_MAX_LENGTH = Notification._meta.get_field("dedupe_key").max_length or 200


def stored_dedupe_key(key: str) -> str:
    """The key as the column holds it: as given up to its length; a longer one as its start and a SHA-256 of the
    whole key (stable: a retry still finds it). Cut to the column, two keys that differed only past it were one,
    and the second event was dropped as a repeat (found by review)."""
    if len(key) <= DEDUPE_KEY_MAX_LENGTH:
        return key
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{key[:DEDUPE_KEY_MAX_LENGTH - len(digest) - 1]}#{digest}"


def envelope(*, event_id: str, kind: str, title: str, message: str, payload: dict[str, Any], at: str) -> str:
    """The JSON body of a webhook: the same for every attempt (compact, keys sorted)."""
    return json.dumps({"id": event_id, "type": kind, "created_at": at, "title": title, "message": message,
                       "data": payload}, separators=(",", ":"), sort_keys=True, default=str)


def channels_for(*, user_id: int, kind: str) -> tuple[bool, bool, bool]:
    """(in_app, email, webhook) for this user and kind: their preference, or every channel (always for a kind no
    preference covers: PREFERENCE_KINDS)."""
    if kind not in PREFERENCE_KINDS:
        return (True, True, True)
    row = Preference.objects.filter(user_id=user_id, kind=kind).values_list("in_app", "email", "webhook").first()
    return row if row is not None else (True, True, True)


def email_wanted(*, user: User, kind: str) -> bool:
    """Whether an e-mail of `kind` that another app sends itself (billing.services.notify.event_create) may go to
    the user: an address, and the e-mail channel of their preference for the kind on. The mails that must always go
    (sign-up, password reset, e-mail verification, the security changes of core.security_mail) ask nothing here."""
    if kind not in Kind.values or kind == Kind.TEST:
        raise ValueError(f"unknown notification kind {kind!r}")
    return bool(user.email) and channels_for(user_id=user.pk, kind=kind)[1]


def notify(*, user: User, kind: str, payload: dict[str, Any], dedupe_key: str,
           title: str = "") -> Notification | None:
    """Tell `user` about an event of `kind`, once per `dedupe_key`, on the channels they chose.

    `payload` is JSON data (ids, amounts as strings); its `message`, when there is one, is the sentence the user
    reads. `title`, when given, replaces the kind's (TITLES): for a caller whose event the kind's words do not fit
    (a reversal giving a provider's earnings back is a `credit_posted`, not a credit to a balance). Returns the
    notification, or None when this key was notified before (nothing is written then).
    """
    if kind not in Kind.values or kind == Kind.TEST:
        raise ValueError(f"unknown notification kind {kind!r}")
    if kind in EMAIL_ONLY_KINDS:
        raise ValueError(f"{kind!r} is only e-mailed (email_wanted), never a notice")
    if not dedupe_key:
        raise ValueError("a notification needs a dedupe_key")
    payload = json.loads(json.dumps(payload, default=str))  # what is stored is what is sent
    in_app, email, webhook = channels_for(user_id=user.pk, kind=kind)
    emailed = email and bool(user.email)
    now = timezone.now()
    title = (title or _title(kind, payload))[:200]
    with transaction.atomic():
        try:
            with transaction.atomic():
                notification = Notification.objects.create(
                    user=user, kind=kind, title=title, body=str(payload.get("message", ""))[:5000],
                    payload=payload, dedupe_key=stored_dedupe_key(dedupe_key), in_app=in_app, created_at=now,
                    email_status=EmailStatus.PENDING if emailed else EmailStatus.NONE,
                    email_next_at=now if emailed else None)
        except IntegrityError:
            return None
        if emailed:
            dispatch.enqueue_on_commit(EMAIL_SEND, notification.pk, 0)
        if webhook:
            for endpoint in _endpoints_kept(user_id=user.pk):
                if not endpoint.receives(kind, payload):  # added by a key of the other role (KIND_ROLES)
                    continue
                delivery_queue(endpoint=endpoint, kind=kind, notification=notification, payload=payload,
                               title=notification.title, message=notification.body)
    return notification


def _endpoints_kept(*, user_id: int) -> list[WebhookEndpoint]:
    """The user's active endpoints, each kept until the caller commits (FOR KEY SHARE, the lock a foreign key
    takes; Django has no such lock): a DELETE of one meanwhile waits and takes its new delivery along, where it
    would otherwise commit first and fail the caller's whole transaction on the delivery's foreign key. Updates
    (a pause) and other notices are not held up. PostgreSQL only: SQLite (the demo's default) has no row locks
    and serialises writes anyway, so there a plain read."""
    if connection.vendor != "postgresql":
        return list(WebhookEndpoint.objects.filter(user_id=user_id, active=True).order_by("pk"))
    table = WebhookEndpoint._meta.db_table
    sql = f"SELECT * FROM {table} WHERE user_id = %s AND active ORDER BY id FOR KEY SHARE"  # noqa: S608 (our table)
    return list(WebhookEndpoint.objects.raw(sql, [user_id]))


def delivery_queue(*, endpoint: WebhookEndpoint, kind: str, payload: dict[str, Any], title: str, message: str,
                   notification: Notification | None = None) -> WebhookDelivery:
    """One delivery row (its body fixed now), sent by the worker once the caller's transaction commits."""
    delivery = WebhookDelivery(endpoint=endpoint, notification=notification, kind=kind,
                               next_attempt_at=timezone.now())
    delivery.body = envelope(event_id=str(delivery.event_id), kind=kind, title=title, message=message,
                             payload=payload, at=delivery.created_at.isoformat())
    delivery.save()
    dispatch.enqueue_on_commit(WEBHOOK_DELIVER, delivery.pk, 0)
    return delivery


# ------------------------------------------------------------------------------------------ in-app list


def notification_mark_read(*, notification: Notification) -> Notification:
    if notification.read_at is None:
        notification.read_at = timezone.now()
        Notification.objects.filter(pk=notification.pk, read_at=None).update(read_at=notification.read_at)
    return notification


def notifications_mark_all_read(*, user: User, scopes: list[str] | tuple[str, ...] | None = None) -> int:
    """Mark the user's unread notices read; with an API key's `scopes`, those of the roles it may read only."""
    mine: QuerySet[Notification] = Notification.objects.filter(kinds_readable(roles_readable(scopes)), user=user,
                                                                in_app=True, read_at=None)
    return mine.update(read_at=timezone.now())


# ------------------------------------------------------------------------------------------ preferences


PREFERENCE_CHANNELS = ("in_app", "email", "webhook")


def _preference_kind_check(kind: str) -> None:
    if kind not in PREFERENCE_KINDS:
        raise ValidationFailed(f"Unknown event kind {kind!r}; one of {', '.join(PREFERENCE_KINDS)}.", field="kind")


def preference_set(*, user: User, kind: str, in_app: bool, email: bool, webhook: bool) -> Preference:
    _preference_kind_check(kind)
    preference, _ = Preference.objects.update_or_create(
        user=user, kind=kind, defaults={"in_app": in_app, "email": email, "webhook": webhook})
    return preference


def preference_change(*, user: User, kind: str, channels: dict[str, bool]) -> Preference:
    """Set only the given channels of the kind, the others left as they are now (every channel on without a row):
    what a page changed, not what it showed for the others, which may have been changed since (the API, another
    tab)."""
    _preference_kind_check(kind)
    unknown = sorted(set(channels) - set(PREFERENCE_CHANNELS))
    if unknown:
        raise ValidationFailed(f"Unknown channel {unknown[0]!r}; one of {', '.join(PREFERENCE_CHANNELS)}.",
                               field="channels")
    with transaction.atomic():
        preference, created = Preference.objects.select_for_update().get_or_create(user=user, kind=kind,
                                                                                   defaults=channels)
        changed = [] if created else [name for name, on in channels.items() if getattr(preference, name) != on]
        for name in changed:
            setattr(preference, name, channels[name])
        if changed:
            preference.save(update_fields=changed)
    return preference
