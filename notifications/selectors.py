"""Reads: a user's notifications, preferences, endpoints and deliveries (always scoped to the user)."""
from dataclasses import dataclass

from django.db.models import QuerySet

from marketplace.models import User
from notifications.models import (
    PREFERENCE_KINDS,
    Notification,
    Preference,
    WebhookAttempt,
    WebhookDelivery,
    WebhookEndpoint,
)


def notifications_for(*, user: User, unread: bool | None = None) -> QuerySet[Notification]:
    rows = Notification.objects.filter(user=user, in_app=True)
    if unread is True:
        rows = rows.filter(read_at=None)
    elif unread is False:
        rows = rows.exclude(read_at=None)
    return rows.order_by("-created_at", "-id")


def unread_count(*, user: User) -> int:
    return Notification.objects.filter(user=user, in_app=True, read_at=None).count()


@dataclass(frozen=True)
class KindChannels:
    kind: str
    label: str
    in_app: bool
    email: bool
    webhook: bool


def preferences_for(*, user: User) -> list[KindChannels]:
    """Every kind a user can choose channels for, with their choice (every channel on without one)."""
    rows = {p.kind: p for p in Preference.objects.filter(user=user)}
    result = []
    for kind in PREFERENCE_KINDS:
        row = rows.get(kind)
        result.append(KindChannels(kind.value, kind.label, row.in_app if row else True,
                                   row.email if row else True, row.webhook if row else True))
    return result


def endpoints_for(*, user: User) -> QuerySet[WebhookEndpoint]:
    return WebhookEndpoint.objects.filter(user=user).order_by("-created_at", "-id")


def deliveries_for(*, user: User, endpoint_id: int | None = None) -> QuerySet[WebhookDelivery]:
    rows = WebhookDelivery.objects.filter(endpoint__user=user)
    if endpoint_id is not None:
        rows = rows.filter(endpoint_id=endpoint_id)
    return rows.order_by("-created_at", "-id")


def attempts_of(*, delivery: WebhookDelivery) -> QuerySet[WebhookAttempt]:
    return delivery.attempt_log.order_by("number")
