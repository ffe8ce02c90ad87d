"""The ledger: balanced, posted once, append-only, cached balances; the database holds the line too."""
import threading

import pytest
from django.db import IntegrityError, connection, transaction
from django.db.utils import DatabaseError

from billing.models import Account, AccountKind, Entry, LedgerTransaction, Refund, TopUp, TransactionKind
from billing.services.ledger import (
    LedgerError,
    credit_grant,
    ledger_post,
    ledger_reverse,
    platform_account,
    user_account,
    wallet_balance,
)
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def _wallet(user):
    return user_account(user_id=user.pk, kind=AccountKind.CUSTOMER_WALLET)


def test_a_posting_moves_money_between_accounts_and_updates_their_cached_balances():
    user = UserFactory()
    wallet, promo = _wallet(user), platform_account(kind=AccountKind.PROMOTIONS)
    txn, created = ledger_post(idempotency_key="k1", kind=TransactionKind.CREDIT,
                               lines=[(wallet, 5_000_000), (promo, -5_000_000)])
    assert created and txn.entries.count() == 2
    wallet.refresh_from_db()
    promo.refresh_from_db()
    assert (wallet.balance_micros, promo.balance_micros) == (5_000_000, -5_000_000)


def test_the_same_idempotency_key_posts_once():
    user = UserFactory()
    lines = [(_wallet(user), 1), (platform_account(kind=AccountKind.PROMOTIONS), -1)]
    first, created = ledger_post(idempotency_key="once", kind=TransactionKind.CREDIT, lines=lines)
    again, created_again = ledger_post(idempotency_key="once", kind=TransactionKind.CREDIT, lines=lines)
    assert created and not created_again and first.pk == again.pk
    assert wallet_balance(user_id=user.pk) == 1


@pytest.mark.parametrize("amounts", [[5, -4], [5], [0, 0], [1.5, -1.5], [True, -1], ["1", "-1"]])
def test_unbalanced_or_non_integer_postings_are_refused(amounts):
    user = UserFactory()
    accounts = [_wallet(user), platform_account(kind=AccountKind.PROMOTIONS)]
    lines = list(zip(accounts, amounts, strict=False))
    with pytest.raises(LedgerError):
        ledger_post(idempotency_key="bad", kind=TransactionKind.CREDIT, lines=lines)
    assert not LedgerTransaction.objects.exists() and not Entry.objects.exists()


def test_the_database_refuses_an_unbalanced_transaction_and_any_change_to_posted_rows():
    user = UserFactory()
    wallet, promo = _wallet(user), platform_account(kind=AccountKind.PROMOTIONS)
    txn, _ = ledger_post(idempotency_key="ok", kind=TransactionKind.CREDIT, lines=[(wallet, 7), (promo, -7)])
    with pytest.raises(DatabaseError, match="does not balance"), transaction.atomic():
        Entry.objects.create(transaction=txn, account=wallet, amount_micros=1)
    with pytest.raises(DatabaseError, match="does not balance"), transaction.atomic():
        other = LedgerTransaction.objects.create(idempotency_key="raw", kind=TransactionKind.CREDIT)
        Entry.objects.bulk_create([Entry(transaction=other, account=wallet, amount_micros=3),
                                   Entry(transaction=other, account=promo, amount_micros=-2)])
    with pytest.raises(IntegrityError), transaction.atomic():
        Entry.objects.bulk_create([Entry(transaction=txn, account=wallet, amount_micros=0)])
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
        Entry.objects.filter(transaction=txn).update(amount_micros=8)
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
        Entry.objects.filter(transaction=txn).delete()
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
        LedgerTransaction.objects.filter(pk=txn.pk).update(memo="edited")


def test_a_transaction_without_entries_cannot_commit():
    with pytest.raises(DatabaseError, match="at least two entries"), transaction.atomic():
        LedgerTransaction.objects.create(idempotency_key="empty", kind=TransactionKind.CREDIT)
        with connection.cursor() as cursor:
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")  # what COMMIT does with the deferred check
    with connection.cursor() as cursor:
        cursor.execute("SET CONSTRAINTS ALL DEFERRED")


def test_accounts_are_one_per_user_and_kind_and_platform_accounts_have_no_user():
    user = UserFactory()
    assert _wallet(user).pk == _wallet(user).pk
    with pytest.raises(IntegrityError), transaction.atomic():
        Account.objects.create(kind=AccountKind.PLATFORM_REVENUE, user=user)
    with pytest.raises(IntegrityError), transaction.atomic():
        Account.objects.create(kind=AccountKind.CUSTOMER_WALLET, user=None)


def test_a_reversal_undoes_a_transaction_once_with_the_operator_and_reason():
    user, operator = UserFactory(), UserFactory(is_staff=True)
    txn, _ = credit_grant(user=user, amount_micros=3_000_000, reason="goodwill", created_by=operator)
    assert txn.created_by == operator and txn.reason == "goodwill"
    reversal, created = ledger_reverse(txn=txn, reason="credited the wrong customer", created_by=operator)
    again, created_again = ledger_reverse(txn=txn, reason="twice", created_by=operator)
    assert created and not created_again and reversal.pk == again.pk
    assert reversal.reverses == txn and reversal.kind == TransactionKind.REVERSAL
    assert wallet_balance(user_id=user.pk) == 0
    with pytest.raises(LedgerError):
        ledger_reverse(txn=reversal, reason="undo the undo")


@pytest.mark.parametrize(("kind", "says"), [
    (TransactionKind.TOP_UP, "refund the top-up instead"),
    (TransactionKind.REFUND, "the card got the money back"),
    (TransactionKind.PAYOUT, "its transfer was sent"),
    (TransactionKind.PAYOUT_REVERSAL, "they go with the next payout"),
])
def test_money_that_moved_at_stripe_is_not_reversed_in_the_ledger(kind, says):
    """Reversing a payout would give its earnings back while its transfer stands (paid twice); a top-up, take its
    money while the top-up stays refundable: these have their own way back, named in the refusal."""
    user = UserFactory()
    txn, _ = ledger_post(idempotency_key=f"moved-{kind}", kind=kind,
                         lines=[(_wallet(user), 1_000_000), (platform_account(kind=AccountKind.PAYMENT_CLEARING),
                                                             -1_000_000)])
    if kind == TransactionKind.REFUND:  # a refund's posting is always its Refund's (statements list it by it)
        Refund.objects.create(top_up=TopUp.objects.create(user=user, amount_micros=1_000_000), amount_micros=1_000_000,
                              origin="stripe", status="succeeded", stripe_refund_id="re_moved", transaction=txn)
    with pytest.raises(LedgerError, match=says):
        ledger_reverse(txn=txn, reason="operator mistake")
    assert not LedgerTransaction.objects.filter(reverses=txn).exists() and wallet_balance(user_id=user.pk) == 1_000_000


def test_a_credit_needs_a_reason_and_a_positive_integer_amount():
    user = UserFactory()
    with pytest.raises(LedgerError):
        credit_grant(user=user, amount_micros=1_000_000, reason="  ")
    with pytest.raises(LedgerError):
        credit_grant(user=user, amount_micros=-5, reason="x")
    with pytest.raises(LedgerError):
        credit_grant(user=user, amount_micros=1.0, reason="x")


@pytest.mark.django_db(transaction=True)
def test_concurrent_postings_on_the_same_accounts_neither_deadlock_nor_lose_updates():
    a, b = UserFactory(), UserFactory()
    wa, wb, promo = _wallet(a), _wallet(b), platform_account(kind=AccountKind.PROMOTIONS)
    errors = []

    def post(n, lines):
        try:
            for i in range(15):
                ledger_post(idempotency_key=f"t{n}-{i}", kind=TransactionKind.CREDIT, lines=lines)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            connection.close()

    # Opposite orders of the same accounts: without ordered locks these would deadlock.
    threads = [threading.Thread(target=post, args=(0, [(wa, 1), (wb, 1), (promo, -2)])),
               threading.Thread(target=post, args=(1, [(promo, -2), (wb, 1), (wa, 1)])),
               threading.Thread(target=post, args=(2, [(wb, 2), (wa, -1), (promo, -1)]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert wallet_balance(user_id=a.pk) == 15 + 15 - 15 and wallet_balance(user_id=b.pk) == 15 + 15 + 30
