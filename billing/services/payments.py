"""Money coming in and going back, in one namespace: Stripe customers, saved cards, top-ups, webhooks,
refunds. The code lives by area in customers, cards, top_ups, webhooks, reconcile and refunds (this module only
re-exports it); patch names in those modules, not here.
"""
from billing.services.cards import card_add, card_remove, setup_intent_create
from billing.services.customers import customer_for, profile_for
from billing.services.reconcile import top_up_reconcile, top_ups_reconcile
from billing.services.refunds import refund_confirm, refund_create, refundable_micros
from billing.services.top_ups import (
    auto_top_up_start,
    top_up_bounds,
    top_up_charge,
    top_up_charge_by_id,
    top_up_create,
    top_up_credit,
    top_up_for_idempotency_key,
)
from billing.services.webhooks import WebhookInvalid, stripe_event_process, webhook_receive

__all__ = [
    "WebhookInvalid",
    "auto_top_up_start",
    "card_add",
    "card_remove",
    "customer_for",
    "profile_for",
    "refund_confirm",
    "refund_create",
    "refundable_micros",
    "setup_intent_create",
    "stripe_event_process",
    "top_up_bounds",
    "top_up_charge",
    "top_up_charge_by_id",
    "top_up_create",
    "top_up_credit",
    "top_up_for_idempotency_key",
    "top_up_reconcile",
    "top_ups_reconcile",
    "webhook_receive",
]
