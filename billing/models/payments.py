"""Money arriving: billing profiles, saved cards, top-ups and their refunds, the Stripe events that settle them."""
from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from core.idempotency import IDEMPOTENCY_KEY_MAX_LENGTH
from core.transitions import StatefulModel, Transitions

from .ledger import LedgerTransaction


class BillingProfile(models.Model):
    """A user's billing settings and the state of their balance warnings."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="billing_profile")
    stripe_customer_id = models.CharField(max_length=100, null=True, blank=True, unique=True)
    stripe_connect_account_id = models.CharField(
        max_length=100, blank=True, help_text="The provider's Stripe Connect account (acct_...) that payouts go to.")
    auto_top_up_enabled = models.BooleanField(default=False)
    auto_top_up_threshold_micros = models.BigIntegerField(default=0)
    auto_top_up_amount_micros = models.BigIntegerField(default=0)
    auto_top_up_card = models.ForeignKey("Card", on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    auto_top_up_changed_at = models.DateTimeField(
        null=True, blank=True, help_text="When the user last changed their auto top-up: failed automatic top-ups "
                                         "before it do not hold the next one back.")
    # Warning state: set when a warning is sent, cleared when the balance recovers.
    low_balance_warned_at = models.DateTimeField(null=True, blank=True)
    depleted_at = models.DateTimeField(null=True, blank=True, help_text="When the balance reached zero.")
    destroy_warned_at = models.DateTimeField(null=True, blank=True, help_text="When the first destroy warning of "
                                             "this zero balance went out.")
    destroy_deadlines = models.JSONField(
        default=dict, blank=True,
        help_text="What the grace period at zero balance destroys, and when: {\"instance:<id>\" or \"volume:<id>\": "
                  "{\"at\": ISO time, \"warned\": bool}}. A thing is destroyed only once a warning named it with its "
                  "time and that time passed (billing.services.enforcement). Cleared with depleted_at.")
    stop_not_before = models.DateTimeField(
        null=True, blank=True,
        help_text="A cost that rose without a funds check (a price raised back, an interrupted instance resumed) found "
                  "the balance low: the renter was warned then, and their running instances are not stopped at zero "
                  "before this (billing.services.low_balance).")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["id"]

    def __str__(self):
        return f"billing profile of {self.user}"


class Card(models.Model):
    """A card saved at Stripe (a PaymentMethod attached to the user's Stripe customer)."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="cards")
    stripe_payment_method_id = models.CharField(max_length=100, unique=True)
    brand = models.CharField(max_length=30, blank=True)
    last4 = models.CharField(max_length=4, blank=True)
    exp_month = models.PositiveSmallIntegerField(null=True, blank=True)
    exp_year = models.PositiveSmallIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self):
        return f"{self.brand or 'card'} •••• {self.last4}"


class TopUpStatus(models.TextChoices):
    PENDING = "pending", "Pending"  # recorded; Stripe not called yet (or its answer was lost)
    PROCESSING = "processing", "Processing"  # Stripe took the payment; the wallet is credited on its webhook
    SUCCEEDED = "succeeded", "Succeeded"  # credited
    FAILED = "failed", "Failed"  # declined, or Stripe could not be reached: nothing credited


T = TopUpStatus
TOP_UP_TRANSITIONS = Transitions({
    # SUCCEEDED straight from PENDING: Stripe's webhook came before the charge's answer was recorded.
    T.PENDING: {T.PROCESSING, T.SUCCEEDED, T.FAILED},
    T.PROCESSING: {T.SUCCEEDED, T.FAILED},
    # Failed here (Stripe's answer lost) but charged after all: the money arrived, so it is credited; or Stripe has
    # it still processing when the lookup finds it (billing.services.reconcile.top_ups_find_lost).
    T.FAILED: {T.SUCCEEDED, T.PROCESSING},
    T.SUCCEEDED: set(),
})


class TopUp(StatefulModel, models.Model):
    transitions = TOP_UP_TRANSITIONS

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="top_ups")
    amount_micros = models.BigIntegerField()
    card = models.ForeignKey(Card, on_delete=models.SET_NULL, null=True, blank=True, related_name="top_ups")
    card_label = models.CharField(max_length=60, blank=True)
    automatic = models.BooleanField(default=False, help_text="Started by auto top-up.")
    status = models.CharField(max_length=12, choices=TopUpStatus.choices, default=TopUpStatus.PENDING)
    failure_message = models.CharField(max_length=500, blank=True)
    outcome_unknown = models.BooleanField(default=False, help_text=(
        "The charge's answer was lost: whether Stripe charged is not known until the follow-up finds the payment "
        "among the customer's (or finds none)."))
    payment_intent_id = models.CharField(max_length=100, null=True, blank=True, unique=True)
    # The charge (ch_...) that paid it, recorded from the PaymentIntent when credited (or learned from Stripe): a
    # dispute or refund event naming only its charge is matched by it (billing.services.charges).
    charge_id = models.CharField(max_length=100, null=True, blank=True, unique=True)
    idempotency_key = models.CharField(max_length=IDEMPOTENCY_KEY_MAX_LENGTH, blank=True)
    request_fingerprint = models.CharField(max_length=64, blank=True)
    transaction = models.OneToOneField(LedgerTransaction, on_delete=models.PROTECT, null=True, blank=True,
                                       related_name="top_up")
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)
    credited_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name = "top-up"
        constraints = [
            models.CheckConstraint(condition=Q(amount_micros__gt=0), name="top_up_amount_positive"),
            models.UniqueConstraint(fields=["user", "idempotency_key"], condition=~Q(idempotency_key=""),
                                    name="top_up_unique_idempotency_key"),
            TOP_UP_TRANSITIONS.check_constraint("status", "top_up_status_declared"),
            # top_up_credit posts the credit and marks it succeeded in one write.
            models.CheckConstraint(condition=~Q(status=T.SUCCEEDED)
                                   | Q(transaction__isnull=False, credited_at__isnull=False),
                                   name="top_up_succeeded_is_credited"),
        ]

    def __str__(self):
        return f"top-up {self.pk} ({self.status})"


class RefundStatus(models.TextChoices):
    PENDING = "pending", "Pending"  # Stripe's answer not recorded yet: its amount held (Refund.hold), not refunded
    SUCCEEDED = "succeeded", "Succeeded"  # Stripe has it pending, requires_action or succeeded: the wallet is debited
    FAILED = "failed", "Failed"  # failed or canceled at Stripe (or never made): its hold or debit given back


class RefundOrigin(models.TextChoices):
    PLATFORM = "platform", "An operator, through the platform"
    STRIPE = "stripe", "Made at Stripe (its dashboard), not through the platform"


R = RefundStatus
REFUND_TRANSITIONS = Transitions({
    R.PENDING: {R.SUCCEEDED, R.FAILED},
    # refund_confirm for a refund recorded as failed that Stripe made after all.
    R.FAILED: {R.SUCCEEDED},
    # Stripe's refund failed after it was made (it can, days later: a closed card account): the debit is reversed.
    R.SUCCEEDED: {R.FAILED},
})


class Refund(StatefulModel, models.Model):
    """Money given back to the card of a top-up, whoever made it; the wallet is debited when Stripe has it (pending,
    requires_action or succeeded) and given back when it fails or is canceled (billing.services.refunds). An
    operator's refund takes its amount from the wallet at once (`hold`), before Stripe is asked."""

    transitions = REFUND_TRANSITIONS

    top_up = models.ForeignKey(TopUp, on_delete=models.PROTECT, related_name="refunds")
    amount_micros = models.BigIntegerField()
    status = models.CharField(max_length=12, choices=RefundStatus.choices, default=RefundStatus.PENDING)
    origin = models.CharField(max_length=10, choices=RefundOrigin.choices, default=RefundOrigin.PLATFORM)
    stripe_refund_id = models.CharField(max_length=100, null=True, blank=True, unique=True)
    reason = models.TextField(help_text="Why the operator refunded (operators only).")
    customer_note = models.TextField(blank=True, db_default="", help_text="What the customer reads about it.")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, null=True, blank=True,
                                   related_name="+", help_text="The operator; none for a refund made at Stripe.")
    failure_message = models.CharField(max_length=500, blank=True)
    transaction = models.OneToOneField(LedgerTransaction, on_delete=models.PROTECT, null=True, blank=True,
                                       related_name="refund")
    hold = models.OneToOneField(
        LedgerTransaction, on_delete=models.PROTECT, null=True, blank=True, related_name="refund_held",
        help_text="The amount taken from the wallet when the operator asked for the refund (to the refunds-pending "
                  "account), so that it cannot be spent while Stripe's answer is awaited. None for a refund made at "
                  "Stripe and for one reserved before holds were posted (migration 0017): those are debited when "
                  "Stripe has them.")
    # What makes an operator's refund sent twice (a retried API call, an admin form sent again) refund once: the
    # API's Idempotency-Key, or the admin form's token per top-up ("web-<token>:<top-up id>"), unique per operator.
    idempotency_key = models.CharField(max_length=IDEMPOTENCY_KEY_MAX_LENGTH, blank=True, default="")
    request_fingerprint = models.CharField(max_length=64, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    # When the follow-up last looked it up at Stripe (its answer lost): the least recently looked up go first, so
    # that refunds whose lookup Stripe keeps refusing do not hide the others.
    last_tried_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.CheckConstraint(condition=Q(amount_micros__gt=0), name="refund_amount_positive"),
            models.UniqueConstraint(fields=["created_by", "idempotency_key"], condition=~Q(idempotency_key=""),
                                    name="refund_unique_idempotency_key"),
            REFUND_TRANSITIONS.check_constraint("status", "refund_status_declared"),
            # refund_confirm posts the debit and marks it succeeded in one write. (Refunds made at Stripe that were
            # debited before they were kept one by one have no Stripe id: migration 0013.)
            models.CheckConstraint(condition=~Q(status=R.SUCCEEDED)
                                   | Q(transaction__isnull=False, stripe_refund_id__isnull=False)
                                   | Q(transaction__isnull=False, origin=RefundOrigin.STRIPE),
                                   name="refund_succeeded_is_posted"),
            models.CheckConstraint(condition=Q(origin=RefundOrigin.STRIPE) | Q(created_by__isnull=False),
                                   name="refund_platform_has_operator"),
            # Only an operator's refund is held before Stripe is asked; one made at Stripe is settled when told.
            models.CheckConstraint(condition=Q(hold__isnull=True) | Q(origin=RefundOrigin.PLATFORM),
                                   name="refund_hold_platform_only"),
        ]

    def __str__(self):
        return f"refund {self.pk} of top-up {self.top_up_id} ({self.status})"


class StripeEventStatus(models.TextChoices):
    RECEIVED = "received", "Received"
    PROCESSED = "processed", "Processed"
    IGNORED = "ignored", "Ignored"
    FAILED = "failed", "Failed"


E = StripeEventStatus
STRIPE_EVENT_TRANSITIONS = Transitions({
    E.RECEIVED: {E.PROCESSED, E.IGNORED, E.FAILED},
    # Processed again (Stripe's next delivery, or an operator): it may fail again.
    E.FAILED: {E.PROCESSED, E.IGNORED, E.FAILED},
    E.PROCESSED: set(),
    E.IGNORED: set(),
})


class StripeEvent(StatefulModel, models.Model):
    """A webhook event, stored once per Stripe event id: a second delivery finds it and changes nothing."""

    transitions = STRIPE_EVENT_TRANSITIONS

    event_id = models.CharField(max_length=100, unique=True)
    type = models.CharField(max_length=100)
    status = models.CharField(max_length=10, choices=StripeEventStatus.choices, default=StripeEventStatus.RECEIVED)
    payload = models.JSONField()
    error = models.TextField(blank=True)
    deliveries = models.PositiveIntegerField(default=1)
    received_at = models.DateTimeField(default=timezone.now)
    processed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-received_at", "-id"]
        verbose_name = "Stripe event"
        constraints = [
            STRIPE_EVENT_TRANSITIONS.check_constraint("status", "stripe_event_status_declared"),
            models.CheckConstraint(condition=Q(status=E.RECEIVED) | Q(processed_at__isnull=False),
                                   name="stripe_event_processed_has_processed_at"),
        ]

    def __str__(self):
        return f"{self.type} {self.event_id} ({self.status})"
