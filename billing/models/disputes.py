"""Disputes (chargebacks): a top-up's card payment taken back by the card holder's bank, as Stripe tells it."""
from django.db import models
from django.db.models import Q
from django.utils import timezone

from .ledger import LedgerTransaction
from .payments import TopUp


class Dispute(models.Model):
    """One Stripe dispute of a top-up's charge, and what it did to the wallet: `debit` when the bank withdrew the
    funds (billing.services.disputes), `reversal` when the dispute was won and the debit given back. While debited and
    not given back (under dispute, or lost) its amount is not refundable (billing.services.refunds.refundable_micros):
    Stripe has it no more."""

    stripe_dispute_id = models.CharField(max_length=100, unique=True)
    top_up = models.ForeignKey(TopUp, on_delete=models.PROTECT, related_name="disputes")
    amount_micros = models.BigIntegerField()
    bank_reason = models.CharField(max_length=60, blank=True, help_text="The reason the bank gave (Stripe's).")
    debit = models.OneToOneField(LedgerTransaction, on_delete=models.PROTECT, null=True, blank=True,
                                 related_name="dispute")
    reversal = models.OneToOneField(LedgerTransaction, on_delete=models.PROTECT, null=True, blank=True,
                                    related_name="dispute_given_back")
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.CheckConstraint(condition=Q(amount_micros__gt=0), name="dispute_amount_positive"),
            models.CheckConstraint(condition=Q(reversal__isnull=True) | Q(debit__isnull=False),
                                   name="dispute_given_back_was_debited"),
        ]

    def __str__(self):
        return f"dispute {self.stripe_dispute_id} of top-up {self.top_up_id}"

    @property
    def held(self) -> bool:
        """Debited and not given back: under dispute, or lost."""
        return self.debit_id is not None and self.reversal_id is None
