"""Money leaving: payouts of providers' earnings to their Stripe Connect accounts."""
from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from core.transitions import StatefulModel, Transitions

from .ledger import LedgerTransaction


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
    # When a sender last took it up (sent it, or looked its transfer up): the follow-up takes the least recently
    # tried first, so that payouts whose lookup Stripe keeps refusing do not hide the others.
    last_tried_at = models.DateTimeField(null=True, blank=True)
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
