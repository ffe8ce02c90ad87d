"""Reads: a user's notifications, preferences, endpoints and deliveries (always scoped to the user; with an API
key's `scopes`, to the roles it may read too: models.KIND_ROLES. None: a browser session, which sees all)."""
from dataclasses import dataclass

from django.db.models import QuerySet

from marketplace.models import User
from notifications.models import (
    BOTH_ROLES,
    PREFERENCE_KINDS,
    Notification,
    Preference,
    WebhookAttempt,
    WebhookDelivery,
    WebhookEndpoint,
    kinds_readable,
    roles_held,
    roles_readable,
)

Scopes = list[str] | tuple[str, ...] | None


def notifications_for(*, user: User, unread: bool | None = None, scopes: Scopes = None) -> QuerySet[Notification]:
    rows = Notification.objects.filter(kinds_readable(roles_readable(scopes)), user=user, in_app=True)
    if unread is True:
        rows = rows.filter(read_at=None)
    elif unread is False:
        rows = rows.exclude(read_at=None)
    return rows.order_by("-created_at", "-id")


def unread_count(*, user: User, scopes: Scopes = None) -> int:
    return Notification.objects.filter(kinds_readable(roles_readable(scopes)), user=user, in_app=True,
                                       read_at=None).count()


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


def endpoints_for(*, user: User, scopes: Scopes = None) -> QuerySet[WebhookEndpoint]:
    """The user's endpoints; with a key's `scopes`, those whose roles (the scopes of the key that added them) are
    within the roles the key may read: a renter-only key neither sees nor redirects an endpoint that receives the
    provider's events (one added on the settings page receives both). Changing one needs its roles held (the API's
    WebhookEndpointViewSet.get_object): `read` reads them all."""
    rows = WebhookEndpoint.objects.filter(user=user)
    roles = roles_readable(scopes)
    if roles != BOTH_ROLES:  # the user's few endpoints (ENDPOINTS_PER_USER): their scopes compared here
        rows = rows.filter(pk__in=[pk for pk, kept in rows.values_list("pk", "scopes") if roles_held(kept) <= roles])
    return rows.order_by("-created_at", "-id")


def deliveries_for(*, user: User, endpoint_id: int | None = None, scopes: Scopes = None) -> QuerySet[WebhookDelivery]:
    """The user's deliveries; with a key's `scopes`, of the kinds it may read only (a delivery's body is its
    notice's payload)."""
    rows = WebhookDelivery.objects.filter(kinds_readable(roles_readable(scopes), payload="notification__payload"),
                                          endpoint__user=user)
    if endpoint_id is not None:
        rows = rows.filter(endpoint_id=endpoint_id)
    return rows.order_by("-created_at", "-id")


def attempts_of(*, delivery: WebhookDelivery) -> QuerySet[WebhookAttempt]:
    return delivery.attempt_log.order_by("number")
