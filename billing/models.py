"""Money: a double-entry ledger, usage intervals, cards and top-ups, Stripe events, refunds, payouts.

Amounts are integers of micro-dollars (1e-6 USD) everywhere; decimals exist only at the API edge.

The ledger (`Account`, `LedgerTransaction`, `Entry`) is append-only: a mistake is corrected by a
reversing transaction, never by an UPDATE or DELETE. The database enforces what it can
(migration 0002, PostgreSQL): the entries of every transaction sum to zero, and ledger rows and usage
intervals can be neither updated nor deleted; and (migration 0007) every transaction has at least two entries
at COMMIT, and entries and intervals name rows that exist, checked once per statement rather than by per-row
foreign keys. `Account.balance_micros` is a cache of the sum of the
account's entries, written in the same database transaction as the entries (billing.services.ledger).

Sign convention: an account's balance is the sum of its entries. A customer's wallet is positive when
the platform holds their money; a provider's earnings are positive when the platform owes them; the
platform's revenue grows with fees. Money arriving from Stripe is taken from `payment_clearing`
(which goes negative: what Stripe holds for the platform), money leaving for providers' banks goes to
`payout_clearing`, and credits the platform gives away come from `promotions`.
"""
from django.conf import settings
from django.db import models
from django.db.models import F, Q
from django.utils import timezone

from core.transitions import StatefulModel, Transitions


class AccountKind(models.TextChoices):
    CUSTOMER_WALLET = "customer_wallet", "Customer wallet"
    PROVIDER_EARNINGS = "provider_earnings", "Provider earnings"
    PLATFORM_REVENUE = "platform_revenue", "Platform revenue (fees)"
    PAYMENT_CLEARING = "payment_clearing", "Payment clearing (Stripe)"
    PAYOUT_CLEARING = "payout_clearing", "Payout clearing (Stripe Connect)"
    PROMOTIONS = "promotions", "Promotions and manual credits"


USER_ACCOUNT_KINDS = (AccountKind.CUSTOMER_WALLET, AccountKind.PROVIDER_EARNINGS)


class Account(models.Model):
    kind = models.CharField(max_length=20, choices=AccountKind.choices)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, null=True, blank=True,
                             related_name="billing_accounts")
    balance_micros = models.BigIntegerField(default=0, help_text="The sum of its entries (a cache).")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["id"]
        constraints = [
            models.UniqueConstraint(fields=["kind", "user"], condition=Q(user__isnull=False),
                                    name="account_one_per_user_and_kind"),
            models.UniqueConstraint(fields=["kind"], condition=Q(user__isnull=True),
                                    name="account_one_platform_account_per_kind"),
            models.CheckConstraint(
                condition=(Q(kind__in=USER_ACCOUNT_KINDS, user__isnull=False)
                           | (~Q(kind__in=USER_ACCOUNT_KINDS) & Q(user__isnull=True))),
                name="account_user_iff_user_kind",
            ),
        ]

    def __str__(self):
        return f"{self.get_kind_display()} ({self.user})" if self.user_id else self.get_kind_display()


class TransactionKind(models.TextChoices):
    USAGE = "usage", "Usage"
    STORAGE = "storage", "Storage (volumes, stopped instances' disks)"
    TOP_UP = "top_up", "Top-up"
    REFUND = "refund", "Refund"
    CREDIT = "credit", "Manual credit"
    DEBIT = "debit", "Manual debit"
    PAYOUT = "payout", "Payout"
    PAYOUT_REVERSAL = "payout_reversal", "Payout returned"
    REVERSAL = "reversal", "Reversal"
    SERVICE_CREDIT = "service_credit", "Service credit (interruption, charged to the provider)"


class LedgerTransaction(models.Model):
    """A set of entries that sum to zero, posted once: `idempotency_key` is unique."""

    idempotency_key = models.CharField(max_length=200, unique=True)
    kind = models.CharField(max_length=20, choices=TransactionKind.choices)
    memo = models.CharField(max_length=300, blank=True)
    reason = models.TextField(blank=True, help_text="Why an operator posted it (operators only; never shown to the "
                                                    "customer).")
    customer_note = models.TextField(blank=True, db_default="",  # raw INSERTs (metering) leave it out
                                     help_text="What the customer reads about it (statements, notices).")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, null=True, blank=True,
                                   related_name="+", db_index=False,  # rarely searched; written 50,000 times a tick
                                   help_text="The operator, for manual transactions.")
    reverses = models.OneToOneField("self", on_delete=models.PROTECT, null=True, blank=True,
                                    related_name="reversed_by", help_text="The transaction this one undoes.")
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name = "ledger transaction"

    def __str__(self):
        return f"{self.get_kind_display()} #{self.pk}"


class Entry(models.Model):
    # No foreign key constraints: PostgreSQL checks these references once per statement (migration 0007).
    transaction = models.ForeignKey(LedgerTransaction, on_delete=models.PROTECT, related_name="entries",
                                    db_constraint=False)
    # No index of its own: entry_account_txn_idx (account, transaction) serves lookups by account.
    account = models.ForeignKey(Account, on_delete=models.PROTECT, related_name="entries", db_index=False,
                                db_constraint=False)
    amount_micros = models.BigIntegerField()

    class Meta:
        ordering = ["transaction_id", "id"]
        verbose_name_plural = "entries"
        constraints = [
            models.CheckConstraint(condition=~Q(amount_micros=0), name="entry_amount_not_zero"),
        ]
        indexes = [models.Index(fields=["account", "transaction"], name="entry_account_txn_idx")]

    def __str__(self):
        return f"{self.account}: {self.amount_micros}"


class UsageInterval(models.Model):
    """Whole seconds of one instance's running time, charged at its price snapshot.

    The amount is cumulative: the instance's cost after this interval is
    floor(price_per_hour_micros × seconds billed so far / 3600), so totals do not depend on how often
    the meter runs. `fee_micros` goes to the platform, the rest to the provider.
    """

    # No index of its own: the unique (instance, started_at) serves lookups by instance. No foreign key
    # constraints: PostgreSQL checks the references once per statement (migration 0007).
    instance = models.ForeignKey("marketplace.Instance", on_delete=models.PROTECT, related_name="usage_intervals",
                                 db_index=False, db_constraint=False)
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField()
    seconds = models.PositiveIntegerField()
    price_per_hour_micros = models.BigIntegerField()
    platform_fee_bps = models.PositiveIntegerField()
    amount_micros = models.BigIntegerField(help_text="What the renter paid for these seconds.")
    fee_micros = models.BigIntegerField(help_text="The platform's share of amount_micros.")
    transaction = models.OneToOneField(LedgerTransaction, on_delete=models.PROTECT, null=True, blank=True,
                                       related_name="usage_interval", db_constraint=False,
                                       help_text="None when the amount rounds to zero.")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-started_at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["instance", "started_at"], name="usage_one_interval_per_start"),
            models.CheckConstraint(condition=Q(ended_at__gt=F("started_at")), name="usage_interval_not_empty"),
            models.CheckConstraint(condition=Q(seconds__gt=0), name="usage_seconds_positive"),
            models.CheckConstraint(condition=Q(fee_micros__gte=0, fee_micros__lte=F("amount_micros")),
                                   name="usage_fee_within_amount"),
        ]
        indexes = [models.Index(fields=["ended_at"], name="usage_ended_at_idx")]

    def __str__(self):
        return f"instance {self.instance_id} {self.started_at:%Y-%m-%d %H:%M:%S}+{self.seconds}s"

    @property
    def provider_micros(self) -> int:
        return self.amount_micros - self.fee_micros


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
    # Warning state: set when a warning is sent, cleared when the balance recovers.
    low_balance_warned_at = models.DateTimeField(null=True, blank=True)
    depleted_at = models.DateTimeField(null=True, blank=True, help_text="When the balance reached zero.")
    destroy_warned_at = models.DateTimeField(null=True, blank=True)
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
    # Failed here (Stripe unreachable) but charged after all: the money arrived, so it is credited.
    T.FAILED: {T.SUCCEEDED},
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
    payment_intent_id = models.CharField(max_length=100, null=True, blank=True, unique=True)
    idempotency_key = models.CharField(max_length=100, blank=True)
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
    PENDING = "pending", "Pending"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"


R = RefundStatus
REFUND_TRANSITIONS = Transitions({
    R.PENDING: {R.SUCCEEDED, R.FAILED},
    # refund_confirm for a refund recorded as failed that Stripe made after all.
    R.FAILED: {R.SUCCEEDED},
    R.SUCCEEDED: set(),
})


class Refund(StatefulModel, models.Model):
    """Money given back to the card of a top-up; the wallet is debited when Stripe confirms it."""

    transitions = REFUND_TRANSITIONS

    top_up = models.ForeignKey(TopUp, on_delete=models.PROTECT, related_name="refunds")
    amount_micros = models.BigIntegerField()
    status = models.CharField(max_length=12, choices=RefundStatus.choices, default=RefundStatus.PENDING)
    stripe_refund_id = models.CharField(max_length=100, null=True, blank=True, unique=True)
    reason = models.TextField(help_text="Why the operator refunded (operators only).")
    customer_note = models.TextField(blank=True, db_default="", help_text="What the customer reads about it.")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    failure_message = models.CharField(max_length=500, blank=True)
    transaction = models.OneToOneField(LedgerTransaction, on_delete=models.PROTECT, null=True, blank=True,
                                       related_name="refund")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.CheckConstraint(condition=Q(amount_micros__gt=0), name="refund_amount_positive"),
            REFUND_TRANSITIONS.check_constraint("status", "refund_status_declared"),
            # refund_confirm posts the debit and marks it succeeded in one write.
            models.CheckConstraint(condition=~Q(status=R.SUCCEEDED)
                                   | Q(transaction__isnull=False, stripe_refund_id__isnull=False),
                                   name="refund_succeeded_is_posted"),
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


class PayoutStatus(models.TextChoices):
    PENDING = "pending", "Pending"  # earnings reserved; the transfer is being sent (or will be retried)
    PAID = "paid", "Paid"
    FAILED = "failed", "Failed"  # Stripe refused it; the earnings were given back


P = PayoutStatus
PAYOUT_TRANSITIONS = Transitions({
    P.PENDING: {P.PAID, P.FAILED},
    P.PAID: set(),
    P.FAILED: set(),
})


class Payout(StatefulModel, models.Model):
    """One transfer of a provider's earnings to their Stripe Connect account, at most one per period."""

    transitions = PAYOUT_TRANSITIONS

    provider = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="payouts")
    period_start = models.DateField()
    period_end = models.DateField()
    amount_micros = models.BigIntegerField()
    destination = models.CharField(max_length=100)
    status = models.CharField(max_length=10, choices=PayoutStatus.choices, default=PayoutStatus.PENDING)
    transfer_id = models.CharField(max_length=100, null=True, blank=True, unique=True)
    failure_message = models.CharField(max_length=500, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    transaction = models.OneToOneField(LedgerTransaction, on_delete=models.PROTECT, related_name="payout")
    reversal = models.OneToOneField(LedgerTransaction, on_delete=models.PROTECT, null=True, blank=True,
                                    related_name="payout_reversed")
    created_at = models.DateTimeField(default=timezone.now)
    paid_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-period_start", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["provider", "period_start"], name="payout_one_per_provider_and_period"),
            models.CheckConstraint(condition=Q(amount_micros__gt=0), name="payout_amount_positive"),
            PAYOUT_TRANSITIONS.check_constraint("status", "payout_status_declared"),
            # payout_send records the transfer with the status; _payout_failed the reversal of the earnings.
            models.CheckConstraint(condition=~Q(status=P.PAID) | Q(paid_at__isnull=False, transfer_id__isnull=False),
                                   name="payout_paid_has_transfer"),
            models.CheckConstraint(condition=~Q(status=P.FAILED) | Q(reversal__isnull=False),
                                   name="payout_failed_is_reversed"),
        ]

    def __str__(self):
        return f"payout {self.pk} to {self.provider} ({self.status})"


class EventKind(models.TextChoices):
    LOW_BALANCE = "low_balance", "Low balance"
    BALANCE_DEPLETED = "balance_depleted", "Balance depleted: instances stopped"
    DESTROY_WARNING = "destroy_warning", "Stopped instances will be destroyed"
    INSTANCES_DESTROYED = "instances_destroyed", "Stopped instances destroyed"
    TOP_UP_SUCCEEDED = "top_up_succeeded", "Top-up credited"
    TOP_UP_FAILED = "top_up_failed", "Top-up failed"
    REFUND = "refund", "Refund"
    CREDIT = "credit", "Credit"
    CREDIT_REVERSED = "credit_reversed", "Credit reversed"
    PAYOUT_PAID = "payout_paid", "Payout sent"
    PAYOUT_FAILED = "payout_failed", "Payout failed"
    INSTANCE_INTERRUPTED = "instance_interrupted", "Instance interrupted"
    INSTANCE_RESUMED = "instance_resumed", "Instance resumed"
    INSTANCE_LOST = "instance_lost", "Instance lost with its node"
    SERVICE_CREDIT = "service_credit", "Service credit"
    PRICE_CUT = "price_cut", "Price cut: hardware measured worse"


class BillingEvent(models.Model):
    """Something about a user's money they should know; readable in the API, some also emailed."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="billing_events")
    kind = models.CharField(max_length=24, choices=EventKind.choices)
    message = models.TextField()
    data = models.JSONField(default=dict, blank=True)
    emailed = models.BooleanField(default=False)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["user", "-created_at"], name="billing_event_user_idx")]

    def __str__(self):
        return f"{self.kind} for {self.user}"
