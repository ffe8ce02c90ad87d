"""Migration 0013 keeps what was posted before it: each `dispute:<id>` debit becomes a Dispute of the top-up its memo
names (won: with its reversal), and each dashboard refund debited by the charge's refunded total
(`charge-refunded:<top-up>:<cents>`) a Refund made at Stripe, without a Stripe id, that the first event naming a
refund of that top-up and amount adopts. The ledger rows are posted as the code before 0013 posted them, the
database taken back to 0012 and forward again (to the latest migrations: the tests after this one need every
column)."""
import pytest
from django.db import connection, transaction
from django.db.migrations.executor import MigrationExecutor

from billing.models import AccountKind, Dispute, Refund, TransactionKind
from billing.services.ledger import ledger_post, platform_account, user_account
from billing.services.refunds import refundable_micros
from tests import migration_steps
from tests.billing.helpers import balance
from tests.billing.test_disputes import PROCESSED, USD_100, answer, credited_top_up
from tests.billing.test_refunds_at_stripe import refund_event

BEFORE = [("billing", "0012_chargebacks")]


def _migrate(targets=None):
    """To `targets`, or (None) to the latest migration of every app (tests/migration_steps.py)."""
    migration_steps.migrate(MigrationExecutor(connection), targets)


def _old_debit(top_up, key: str, kind: str, amount: int, memo: str, reason: str = "", reverses=None):
    wallet = user_account(user_id=top_up.user_id, kind=AccountKind.CUSTOMER_WALLET)
    with transaction.atomic():
        txn, _ = ledger_post(idempotency_key=key, kind=kind, memo=memo, reason=reason, reverses=reverses,
                             lines=[(wallet, -amount), (platform_account(kind=AccountKind.PAYMENT_CLEARING), amount)])
    return txn


@pytest.mark.django_db(transaction=True)
def test_disputes_and_dashboard_refunds_posted_before_the_migration_are_kept_as_rows(anon, user):
    top_up = credited_top_up(user)
    held = _old_debit(top_up, "dispute:dp_old", TransactionKind.CHARGEBACK, 30_000_000,
                      f"Dispute dp_old of top-up {top_up.pk} (pi_disputed)",
                      "Chargeback: the card holder's bank took the payment back (Stripe dispute dp_old, reason: "
                      "fraudulent).")
    won = _old_debit(top_up, "dispute:dp_won", TransactionKind.CHARGEBACK, 10_000_000,
                     f"Dispute dp_won of top-up {top_up.pk} (pi_disputed)")
    back = _old_debit(top_up, "dispute-won:dp_won", TransactionKind.REVERSAL, -10_000_000, "won", reverses=won)
    outside = _old_debit(top_up, f"charge-refunded:{top_up.pk}:2500", TransactionKind.REFUND, 25_000_000,
                         f"Refund of top-up {top_up.pk} made at Stripe, not here (charge ch_1)")
    try:
        _migrate(BEFORE)
    finally:
        _migrate()
    old = Dispute.objects.get(stripe_dispute_id="dp_old")
    assert (old.top_up_id, old.amount_micros, old.debit, old.reversal, old.bank_reason) == (
        top_up.pk, 30_000_000, held, None, "fraudulent")
    assert Dispute.objects.get(stripe_dispute_id="dp_won").reversal == back
    refund = Refund.objects.get()
    assert (refund.origin, refund.status, refund.stripe_refund_id, refund.transaction, refund.amount_micros,
            refund.created_by) == ("stripe", "succeeded", None, outside, 25_000_000, None)
    assert refundable_micros(top_up=top_up) == USD_100 - 25_000_000 - 30_000_000
    # The refund's own event, later: it takes the recorded refund (same top-up and amount), and its failure gives
    # the debit back once.
    assert balance(user) == USD_100 - 55_000_000
    assert answer(anon, refund_event("evt_f", kind="refund.failed", refund_id="re_old", status="failed")) == PROCESSED
    refund.refresh_from_db()
    assert (refund.stripe_refund_id, refund.status) == ("re_old", "failed")
    assert balance(user) == USD_100 - 30_000_000 and Refund.objects.count() == 1
