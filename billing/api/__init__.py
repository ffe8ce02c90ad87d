"""The billing API under /api/v1/billing/: balance, usage, cards, top-ups, the Stripe webhook, events,
statements, earnings, payouts, the billing profile, and refunds (operators).

Thin: serializers check input, billing.services does the work, and its errors (core.errors) are answered
by the one handler, core.api.errors. Amounts are USD decimal strings (six places out; whole cents in).

By area: common (shared fields and error descriptions), wallet (balance, usage, events, profile), cards,
top_ups (top-ups and refunds), webhooks, statements, providers (earnings, payouts). Routes: billing.urls.
"""
