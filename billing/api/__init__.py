"""The billing API under /api/v1/billing/: balance, usage, cards, top-ups, the Stripe webhook, events,
statements, earnings, payouts, the billing profile, and refunds (operators).

Thin: serializers check input, billing.services does the work, PaymentError becomes its HTTP answer
here. Amounts are USD decimal strings (six places out; whole cents in).

By area: common (shared fields and error answers), wallet (balance, usage, events, profile), cards,
top_ups (top-ups and refunds), webhooks, statements, providers (earnings, payouts). Routes: billing.urls.
"""
