"""The double-entry ledger (accounts, transactions, entries) and the usage intervals metering posts to it.

Append-only; what the database enforces is told in billing/models/__init__.py.
"""
from django.conf import settings
from django.db import models
from django.db.models import F, Q
from django.utils import timezone


class AccountKind(models.TextChoices):
    CUSTOMER_WALLET = "customer_wallet", "Customer wallet"
    PROVIDER_EARNINGS = "provider_earnings", "Provider earnings"
    PLATFORM_REVENUE = "platform_revenue", "Platform revenue (fees)"
    PAYMENT_CLEARING = "payment_clearing", "Payment clearing (Stripe)"
    PAYOUT_CLEARING = "payout_clearing", "Payout clearing (Stripe Connect)"
    PROMOTIONS = "promotions", "Promotions and manual credits"
    # Money an operator's refund holds back from the wallet while Stripe's answer is awaited (billing.services.refunds):
    # moved to payment clearing when the refund is made, back to the wallet when it is not.
    REFUNDS_PENDING = "refunds_pending", "Refunds pending (held for a refund to the card)"


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
    REFUND_HOLD = "refund_hold", "Refund (held until the card is refunded)"
    CREDIT = "credit", "Manual credit"
    DEBIT = "debit", "Manual debit"
    PAYOUT = "payout", "Payout"
    PAYOUT_REVERSAL = "payout_reversal", "Payout returned"
    REVERSAL = "reversal", "Reversal"
    SERVICE_CREDIT = "service_credit", "Service credit (interruption, charged to the provider)"
    CHARGEBACK = "chargeback", "Chargeback (a card payment disputed at the bank)"


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


class EarningsRollup(models.Model):
    """A provider's earnings account's entries summed by month (UTC, of their transaction) and by node: what the
    earnings page and API read (billing.selectors.earnings_for, earnings_by_node) instead of every entry.

    Written by the database, in the statement that inserts the entries (PostgreSQL: a trigger of migration 0022, so
    every way of posting, the metering tick's set-based SQL included, keeps it), never by the application. A
    posting locks its accounts first (billing.services.ledger), so the rows of one earnings account are only
    written under that account's lock: the rollup adds no lock order of its own. Payouts and their reversals are
    not in it: whether a payout counts is its status, read with the payouts (few) when the earnings are.
    Other databases (the SQLite first run) keep no rollup: their reads sum the entries.
    """

    account = models.ForeignKey(Account, on_delete=models.PROTECT, related_name="+",
                                db_index=False)  # the unique (account, month, node_id) leads with it
    month = models.DateField(help_text="The first day of the month (UTC) its transactions were posted in.")
    node_id = models.BigIntegerField(
        default=0, help_text="The node the sales were for (by the charge's key); 0: no node's (service credits, "
                             "manual corrections).")
    earned_micros = models.BigIntegerField(default=0, help_text="Every entry but payouts' and their reversals'.")
    sales_micros = models.BigIntegerField(
        default=0, help_text="Of it, the entries of GPU time and storage charges and their reversals.")
    fees_micros = models.BigIntegerField(
        default=0, help_text="The platform's fee on those charges (its revenue's entries in the same transactions).")

    class Meta:
        ordering = ["account", "month", "node_id"]
        constraints = [models.UniqueConstraint(fields=["account", "month", "node_id"],
                                               name="earnings_rollup_one_per_month_and_node")]

    def __str__(self):
        return f"{self.account_id} {self.month:%Y-%m} node {self.node_id}"



class RevenueSlot(models.Model):
    """The operators' revenue figures (billing.selectors.revenue_between) of one settled slot of ten minutes (UTC):
    what renters were charged for GPU time and storage, and what the platform-revenue account received, by the
    ledger transactions dated in [start, start + 10 min), both net of reversals. Integer micro-dollars.

    A cache, written by the reads themselves (the first dashboard load that needs a slot sums its entries once),
    only for slots over by billing.selectors.REVENUE_SETTLED_AFTER: a transaction is dated when it is posted
    (billing.services.ledger.ledger_post) and the ledger is append-only, so such a slot's sums never change.
    Deleting rows is harmless: they are summed again.
    """

    start = models.DateTimeField(unique=True, help_text="The slot's first instant (UTC, a multiple of 10 minutes).")
    charged_micros = models.BigIntegerField(help_text="What renters were charged for GPU time and storage.")
    fee_micros = models.BigIntegerField(help_text="The platform-revenue account's entries.")

    class Meta:
        ordering = ["start"]

    def __str__(self):
        return f"{self.start:%Y-%m-%d %H:%M}"
