"""Notifications: what a user is told (one row per event, de-duplicated), how they want to be told (preferences
per event kind), and where their signed webhooks go (endpoints, deliveries and each delivery's attempts)."""
import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from core.api.scopes import ALL_SCOPES, PROVIDER, RENTER, missing_scopes
from core.idempotency import IDEMPOTENCY_KEY_MAX_LENGTH
from core.transitions import StatefulModel, Transitions


class Kind(models.TextChoices):
    LOW_BALANCE = "low_balance", "Low balance"
    INSTANCE_RUNNING = "instance_running", "Instance running"
    INSTANCE_STOPPED = "instance_stopped", "Instance stopped"
    INSTANCE_FAILED = "instance_failed", "Instance failed"
    INSTANCE_INTERRUPTED = "instance_interrupted", "Instance interrupted"
    INSTANCE_STOPPED_BY_OPERATOR = "instance_stopped_by_operator", "Instance stopped by the operators"
    INSTANCE_DESTROYED_BY_OPERATOR = "instance_destroyed_by_operator", "Instance destroyed by the operators"
    VOLUME_LOST = "volume_lost", "Volume lost (its server retired, or the volume missing on it)"
    NODE_OFFLINE = "node_offline", "Node offline"
    NODE_REJECTED = "node_rejected", "Node rejected by the benchmark check"
    NODE_DEGRADED = "node_degraded", "Node listed as degraded"
    NODE_MIG_LAYOUT_DUE = "node_mig_layout_due", "A GPU is free for its declared MIG layout"
    NODE_CHANGED_BY_OPERATOR = "node_changed_by_operator", (
        "Node retired, unlisted or put into maintenance by the operators")
    PAYOUT_SENT = "payout_sent", "Payout sent"
    CREDIT_POSTED = "credit_posted", "Credit posted"
    CREDIT_REVERSED = "credit_reversed", "Credit reversed"
    ACCOUNT_DEACTIVATED = "account_deactivated", "Account deactivated by the operators"
    ACCOUNT_REACTIVATED = "account_reactivated", "Account reactivated"
    WEBHOOK_ENDPOINT_DISABLED = "webhook_endpoint_disabled", "Webhook endpoint paused after failing for days"
    BILLING_NOTICE = "billing_notice", (
        "Billing notices by e-mail (a zero balance, top-ups, refunds, disputes, price changes, failed payouts, "
        "volumes not deleted)")
    TEST = "test", "Test event"


# The kinds a user can choose channels for. Not the test event (sent only to the endpoint it is asked for), nor an
# account's deactivation and reactivation: told on every channel, since a deactivated owner cannot log in to read
# the list or change a preference (marketplace.services.account_status).
ALWAYS_ON_KINDS = (Kind.TEST, Kind.ACCOUNT_DEACTIVATED, Kind.ACCOUNT_REACTIVATED)
PREFERENCE_KINDS = [k for k in Kind if k not in ALWAYS_ON_KINDS]

# Kinds whose only channel is e-mail: the billing events (billing.services.notify.event_create) that are e-mailed,
# read otherwise in the billing events list, not as notices; no notice of these kinds is written (notify() refuses
# them), so their in-app and webhook choices would decide nothing and the settings page offers only the e-mail box.
EMAIL_ONLY_KINDS = (Kind.BILLING_NOTICE,)


# Whose each kind is, as API key scopes split an account (core/api/scopes.py): a key with only `renter` reads, and an
# endpoint it adds receives, the renter's kinds and the account's; one with only `provider` the provider's and the
# account's (review r55: a provider-only key read the wallet's balance in `low_balance` notices). A credit and its
# reversal are the renter's (the wallet) unless their payload's `account` is the provider's earnings
# (billing.services.ledger._reversal_tell), as the billing events are split (billing/api/wallet.py PROVIDER_EVENTS).
# Every kind is listed (tests/notifications/test_round55_kind_roles.py): a new kind must say whose it is.
ROLE_ACCOUNT = "account"  # both roles': the account itself, the endpoints, the test event
ROLE_BY_ACCOUNT = "by_account"  # the renter's, or the provider's when payload["account"] is EARNINGS_ACCOUNT
EARNINGS_ACCOUNT = "provider_earnings"  # billing.models.AccountKind.PROVIDER_EARNINGS (the test compares them)
KIND_ROLES: dict[str, str] = {
    Kind.LOW_BALANCE: RENTER,
    Kind.INSTANCE_RUNNING: RENTER,
    Kind.INSTANCE_STOPPED: RENTER,
    Kind.INSTANCE_FAILED: RENTER,
    Kind.INSTANCE_INTERRUPTED: RENTER,
    Kind.INSTANCE_STOPPED_BY_OPERATOR: RENTER,
    Kind.INSTANCE_DESTROYED_BY_OPERATOR: RENTER,
    Kind.VOLUME_LOST: RENTER,
    Kind.NODE_OFFLINE: PROVIDER,
    Kind.NODE_REJECTED: PROVIDER,
    Kind.NODE_DEGRADED: PROVIDER,
    Kind.NODE_MIG_LAYOUT_DUE: PROVIDER,
    Kind.NODE_CHANGED_BY_OPERATOR: PROVIDER,
    Kind.PAYOUT_SENT: PROVIDER,
    Kind.CREDIT_POSTED: ROLE_BY_ACCOUNT,
    Kind.CREDIT_REVERSED: ROLE_BY_ACCOUNT,
    Kind.ACCOUNT_DEACTIVATED: ROLE_ACCOUNT,
    Kind.ACCOUNT_REACTIVATED: ROLE_ACCOUNT,
    Kind.WEBHOOK_ENDPOINT_DISABLED: ROLE_ACCOUNT,
    # E-mail only (never a notice nor a delivery), and of both roles' events (top-ups, failed payouts).
    Kind.BILLING_NOTICE: ROLE_ACCOUNT,
    Kind.TEST: ROLE_ACCOUNT,
}
BOTH_ROLES = frozenset({RENTER, PROVIDER})


def roles_readable(scopes: list[str] | tuple[str, ...] | None) -> frozenset[str]:
    """The roles (renter, provider) whose rows a key with `scopes` may read, as the API's scope rules decide a GET
    (`read` reads both); both for None (a browser session, never scoped)."""
    if scopes is None:
        return BOTH_ROLES
    return frozenset(r for r in (RENTER, PROVIDER) if not missing_scopes(scopes=scopes, rule=(r,), method="GET"))


def roles_held(scopes: list[str] | tuple[str, ...] | None) -> frozenset[str]:
    """The roles a key with `scopes` may act as (write): its `renter` and `provider` scopes; both for None."""
    return BOTH_ROLES if scopes is None else BOTH_ROLES & frozenset(scopes)


def kind_role(kind: str, payload: dict | None) -> str:
    """The role of one event (ROLE_ACCOUNT: both): KIND_ROLES, a credit's decided by its payload's account."""
    role = KIND_ROLES[kind]
    if role == ROLE_BY_ACCOUNT:
        return PROVIDER if (payload or {}).get("account") == EARNINGS_ACCOUNT else RENTER
    return role


def kinds_readable(roles: frozenset[str], *, payload: str = "payload") -> Q:
    """The rows (of notifications, or deliveries with `payload="notification__payload"`) of the kinds a holder of
    `roles` may read: Q() for both roles. A credit without an `account` in its payload (an operator's credit to
    the wallet) is the renter's."""
    if BOTH_ROLES <= roles:
        return Q()
    by_account = [k for k, r in KIND_ROLES.items() if r == ROLE_BY_ACCOUNT]
    shown = Q(kind__in=[k for k, r in KIND_ROLES.items() if r == ROLE_ACCOUNT or r in roles])
    earnings = Q(**{f"{payload}__account": EARNINGS_ACCOUNT})
    if PROVIDER in roles:
        shown |= Q(kind__in=by_account) & earnings
    if RENTER in roles:
        shown |= Q(kind__in=by_account) & (Q(**{f"{payload}__account__isnull": True}) | ~earnings)
    return shown


class Channels(models.Model):
    """The three channels (abstract: a preference row, and the defaults a user without one gets)."""

    in_app = models.BooleanField(default=True)
    email = models.BooleanField(default=True)
    webhook = models.BooleanField(default=True)

    class Meta:
        abstract = True


class Preference(Channels):
    """A user's choice of channels for one kind of event; without a row, every channel is on."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    kind = models.CharField(max_length=32, choices=Kind.choices)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["user", "kind"], name="notification_pref_one_per_kind"),
            models.CheckConstraint(condition=~Q(kind=Kind.TEST), name="notification_pref_not_test"),
        ]

    def __str__(self):
        return f"{self.kind} for {self.user_id}"


class EmailStatus(models.TextChoices):
    NONE = "none", "Not e-mailed"  # the user's choice for the kind, or no address
    PENDING = "pending", "To send"
    SENDING = "sending", "Being sent"  # claimed by a worker (notifications/services/email.py)
    SENT = "sent", "Sent"
    FAILED = "failed", "Not sent"


_E = EmailStatus
EMAIL_TRANSITIONS = Transitions({
    _E.NONE: set(),
    _E.PENDING: {_E.SENDING, _E.SENT, _E.FAILED},
    _E.SENDING: {_E.PENDING, _E.SENT, _E.FAILED},  # pending again: a failure to retry, or a claim lost with its worker
    _E.SENT: set(),
    _E.FAILED: set(),
})


class Notification(StatefulModel, models.Model):
    """One event told to one user: at most one per (user, dedupe_key), whatever the callers do twice. Its e-mail,
    when the user gets one, is claimed before it is sent (`email_status`, notifications/services/email.py)."""

    transitions = EMAIL_TRANSITIONS
    state_field = "email_status"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="notifications")
    kind = models.CharField(max_length=32, choices=Kind.choices)
    title = models.CharField(max_length=200)
    body = models.TextField(blank=True)
    payload = models.JSONField(default=dict, blank=True)
    dedupe_key = models.CharField(max_length=200)
    in_app = models.BooleanField(default=True, help_text="Shown in the user's list (their preference then).")
    emailed_at = models.DateTimeField(null=True, blank=True)
    email_status = models.CharField(max_length=12, choices=EmailStatus.choices, default=EmailStatus.NONE)
    email_attempts = models.PositiveSmallIntegerField(default=0)
    email_next_at = models.DateTimeField(null=True, blank=True, help_text="When a pending e-mail is due (again).")
    email_claimed_at = models.DateTimeField(null=True, blank=True, help_text="When the worker sending it claimed it.")
    email_error = models.CharField(max_length=500, blank=True, help_text="The last attempt's error, or why not sent.")
    read_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["user", "dedupe_key"], name="notification_once_per_key"),
            EMAIL_TRANSITIONS.check_constraint("email_status", "notification_email_status_valid"),
        ]
        indexes = [
            models.Index(fields=["email_next_at"], condition=Q(email_status="pending"),
                         name="notification_email_due_idx"),
            models.Index(fields=["email_claimed_at"], condition=Q(email_status="sending"),
                         name="notification_email_sending_idx"),
            models.Index(fields=["user", "-created_at"], condition=Q(in_app=True), name="notification_list_idx"),
            models.Index(fields=["user"], condition=Q(in_app=True, read_at=None), name="notification_unread_idx"),
        ]

    def __str__(self):
        return f"{self.kind} for {self.user_id}"


def all_scopes() -> list[str]:
    """An endpoint added on the settings page (a session: never scoped), or before scopes were kept, gets all."""
    return list(ALL_SCOPES)


class WebhookEndpoint(models.Model):
    """A URL of the user's that receives their events as signed JSON POSTs. The signing secret is stored
    encrypted and shown once, when the endpoint is created."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="webhook_endpoints")
    url = models.URLField(max_length=500)
    description = models.CharField(max_length=200, blank=True)
    secret_encrypted = models.BinaryField()
    secret_hint = models.CharField(max_length=16, help_text="The secret's first characters, to tell them apart.")
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)
    request_key = models.CharField(max_length=IDEMPOTENCY_KEY_MAX_LENGTH, blank=True, default="", help_text=(
        "The page form's token (web-...) or the API request's Idempotency-Key it was added with: the same request "
        "sent twice adds one endpoint."))
    request_fingerprint = models.CharField(max_length=64, blank=True, default="", help_text=(
        "SHA-256 of the API request's body (core.idempotency.request_fingerprint): the same Idempotency-Key with "
        "another body is refused. Empty for the page form's, whose values are compared instead."))
    failing_since = models.DateTimeField(null=True, blank=True, help_text=(
        "The first failed attempt since the last delivered one (none: the last attempt was delivered)."))
    disabled_at = models.DateTimeField(null=True, blank=True, help_text=(
        "When the platform paused it for failing every attempt too long; cleared when it is resumed."))
    disabled_reason = models.CharField(max_length=300, blank=True, help_text=(
        "Why the platform paused it (empty: active, or paused by its owner)."))
    scopes = models.JSONField(default=all_scopes, help_text=(
        "The scopes of the API key that added it (every scope: added on the settings page, or before scopes were "
        "kept): it receives the kinds of its `renter` and `provider` scopes and the account's (KIND_ROLES)."))

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["user", "request_key"], condition=~Q(request_key=""),
                                    name="webhook_endpoint_once_per_request"),
        ]

    def __str__(self):
        return f"webhook endpoint {self.pk} ({self.url})"

    @property
    def roles(self) -> frozenset[str]:
        """Whose events it receives (besides the account's): its scopes' `renter` and `provider`."""
        return roles_held(self.scopes)

    def receives(self, kind: str, payload: dict | None) -> bool:
        role = kind_role(kind, payload)
        return role == ROLE_ACCOUNT or role in self.roles


class WebhookTestEvent(models.Model):
    """A test event a user asked for. The hourly limit counts these rather than the test deliveries, which are
    deleted with their endpoint: deleting and adding an endpoint again must not start the limit afresh."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["user", "at"], name="webhook_test_event_user_idx")]

    def __str__(self):
        return f"test event of {self.user_id} at {self.at}"


class DeliveryStatus(models.TextChoices):
    PENDING = "pending", "Pending"
    RETRYING = "retrying", "Retrying"
    SUCCEEDED = "succeeded", "Delivered"
    FAILED = "failed", "Failed"


_D = DeliveryStatus
DELIVERY_TRANSITIONS = Transitions({
    _D.PENDING: {_D.RETRYING, _D.SUCCEEDED, _D.FAILED},
    _D.RETRYING: {_D.RETRYING, _D.SUCCEEDED, _D.FAILED},
    _D.SUCCEEDED: set(),
    _D.FAILED: set(),
})


class WebhookDelivery(StatefulModel, models.Model):
    """One event for one endpoint: the exact body every attempt sends, and where it stands."""

    transitions = DELIVERY_TRANSITIONS

    endpoint = models.ForeignKey(WebhookEndpoint, on_delete=models.CASCADE, related_name="deliveries")
    notification = models.ForeignKey(Notification, on_delete=models.CASCADE, null=True, blank=True,
                                     related_name="deliveries", help_text="None for a test event.")
    event_id = models.UUIDField(default=uuid.uuid4, unique=True)
    kind = models.CharField(max_length=32, choices=Kind.choices)
    body = models.TextField(help_text="The JSON sent, the same in every attempt.")
    status = models.CharField(max_length=12, choices=DeliveryStatus.choices, default=DeliveryStatus.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    last_status_code = models.PositiveIntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=500, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    claimed_at = models.DateTimeField(null=True, blank=True, help_text=(
        "When the attempt in flight was claimed; cleared when it is recorded."))
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "webhook deliveries"
        constraints = [
            DELIVERY_TRANSITIONS.check_constraint("status", "webhook_delivery_status_valid"),
            models.UniqueConstraint(fields=["endpoint", "notification"], name="webhook_delivery_once_per_endpoint"),
        ]
        indexes = [
            models.Index(fields=["endpoint", "-created_at"], name="webhook_delivery_endpoint_idx"),
            models.Index(fields=["next_attempt_at"], condition=Q(status__in=["pending", "retrying"]),
                         name="webhook_delivery_due_idx"),
            # the daily prune's (notifications/services/retention.py)
            models.Index(fields=["finished_at"], condition=Q(finished_at__isnull=False),
                         name="webhook_delivery_finished_idx"),
        ]

    def __str__(self):
        return f"delivery {self.pk} of {self.kind} to endpoint {self.endpoint_id} ({self.status})"


class WebhookAttempt(models.Model):
    """One POST of a delivery: what came back (or the error), when, how long it took."""

    delivery = models.ForeignKey(WebhookDelivery, on_delete=models.CASCADE, related_name="attempt_log")
    number = models.PositiveIntegerField()
    status_code = models.PositiveIntegerField(null=True, blank=True)
    error = models.CharField(max_length=500, blank=True)
    duration_ms = models.PositiveIntegerField(default=0)
    at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["delivery_id", "number"]
        constraints = [models.UniqueConstraint(fields=["delivery", "number"], name="webhook_attempt_once")]

    def __str__(self):
        return f"attempt {self.number} of delivery {self.delivery_id}"
