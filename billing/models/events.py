"""Billing events: what a user should know about their money (read in the API, some e-mailed)."""
from django.conf import settings
from django.db import models
from django.utils import timezone


class EventKind(models.TextChoices):
    LOW_BALANCE = "low_balance", "Low balance"
    BALANCE_DEPLETED = "balance_depleted", "Balance depleted: instances stopped"
    DESTROY_WARNING = "destroy_warning", "Stopped or failed instances and volumes will be destroyed"
    INSTANCES_DESTROYED = "instances_destroyed", "Stopped or failed instances or volumes destroyed"
    TOP_UP_SUCCEEDED = "top_up_succeeded", "Top-up credited"
    TOP_UP_FAILED = "top_up_failed", "Top-up failed"
    REFUND = "refund", "Refund"
    CHARGEBACK = "chargeback", "Card payment disputed: debited"
    CHARGEBACK_REVERSED = "chargeback_reversed", "Dispute won: amount back"
    CREDIT = "credit", "Credit"
    CREDIT_REVERSED = "credit_reversed", "Credit reversed"
    PAYOUT_PAID = "payout_paid", "Payout sent"
    PAYOUT_FAILED = "payout_failed", "Payout failed"
    INSTANCE_INTERRUPTED = "instance_interrupted", "Instance interrupted"
    INSTANCE_RESUMED = "instance_resumed", "Instance resumed"
    INSTANCE_LOST = "instance_lost", "Instance lost with its node"
    SERVICE_CREDIT = "service_credit", "Service credit"
    PRICE_CUT = "price_cut", "Price cut: hardware measured worse"
    PRICE_RAISED_BACK = "price_raised_back", "Price raised back: hardware measured better again"
    VOLUME_NOT_DELETED = "volume_not_deleted", "Volume not deleted: its server refused; billed again"


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
