"""Money: a double-entry ledger, usage intervals, cards and top-ups, Stripe events, refunds,
disputes, payouts.

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
from .disputes import Dispute
from .events import BillingEvent, EventKind
from .ledger import (
    USER_ACCOUNT_KINDS,
    Account,
    AccountKind,
    EarningsRollup,
    Entry,
    LedgerTransaction,
    RevenueSlot,
    TransactionKind,
    UsageInterval,
)
from .payments import (
    REFUND_TRANSITIONS,
    STRIPE_EVENT_TRANSITIONS,
    TOP_UP_TRANSITIONS,
    BillingProfile,
    Card,
    Refund,
    RefundOrigin,
    RefundStatus,
    StripeEvent,
    StripeEventStatus,
    TopUp,
    TopUpStatus,
)
from .payouts import PAYOUT_TRANSITIONS, Payout, PayoutStatus

__all__ = [
    "Account",
    "AccountKind",
    "BillingEvent",
    "BillingProfile",
    "Card",
    "Dispute",
    "EarningsRollup",
    "Entry",
    "EventKind",
    "LedgerTransaction",
    "PAYOUT_TRANSITIONS",
    "Payout",
    "PayoutStatus",
    "REFUND_TRANSITIONS",
    "Refund",
    "RefundOrigin",
    "RefundStatus",
    "RevenueSlot",
    "STRIPE_EVENT_TRANSITIONS",
    "StripeEvent",
    "StripeEventStatus",
    "TOP_UP_TRANSITIONS",
    "TopUp",
    "TopUpStatus",
    "TransactionKind",
    "USER_ACCOUNT_KINDS",
    "UsageInterval",
]
