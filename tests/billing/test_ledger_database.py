"""What PostgreSQL itself refuses in the ledger, whatever the code above it does (migrations 0002 and 0007):
references checked per statement, an account or instance the ledger names cannot be deleted, a transaction
commits with at least two entries, and a usage interval or a usage charge cannot be written twice."""
import threading

import pytest
from django.db import IntegrityError, connection, connections, transaction
from django.db.utils import DatabaseError, OperationalError

from billing.models import AccountKind, LedgerTransaction, TransactionKind, UsageInterval
from billing.services.ledger import ledger_post, platform_account, user_account
from billing.services.metering import usage_meter
from marketplace.models import Instance
from tests.billing.helpers import fund, node, running
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

MISSING = 2**62


def _sql(sql, params=()):
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall() if cursor.description else None


def _posted():
    user = UserFactory()
    wallet, promo = user_account(user_id=user.pk, kind=AccountKind.CUSTOMER_WALLET), \
        platform_account(kind=AccountKind.PROMOTIONS)
    txn, _ = ledger_post(idempotency_key=f"ok:{user.pk}", kind=TransactionKind.CREDIT,
                         lines=[(wallet, 7), (promo, -7)])
    return txn, wallet, promo


def _new_txn(key):
    return _sql("INSERT INTO billing_ledgertransaction (idempotency_key, kind, memo, reason, created_at) "
                "VALUES (%s, 'credit', '', '', now()) RETURNING id", [key])[0][0]


def test_an_entry_naming_a_missing_transaction_or_account_is_refused():
    txn, wallet, promo = _posted()
    with pytest.raises(IntegrityError, match="ledger transaction .* does not exist"), transaction.atomic():
        _sql("INSERT INTO billing_entry (transaction_id, account_id, amount_micros) VALUES (%s, %s, 5), (%s, %s, -5)",
             [MISSING, wallet.pk, MISSING, promo.pk])
    with pytest.raises(IntegrityError, match="account does not exist"), transaction.atomic():
        other = _new_txn("no-account")
        _sql("INSERT INTO billing_entry (transaction_id, account_id, amount_micros) VALUES (%s, %s, 5), (%s, %s, -5)",
             [other, wallet.pk, other, MISSING])


def test_an_interval_naming_a_missing_instance_or_transaction_is_refused(clock):
    renter = UserFactory()
    fund(renter, "100")
    instance = running(renter, node())
    row = "(%s, now(), now() + interval '1 second', 1, 1000, 1500, 0, 0, %s, now())"
    insert = ("INSERT INTO billing_usageinterval (instance_id, started_at, ended_at, seconds, price_per_hour_micros, "
              "platform_fee_bps, amount_micros, fee_micros, transaction_id, created_at) VALUES ")
    with pytest.raises(IntegrityError, match="an instance does not exist"), transaction.atomic():
        earlier = row.replace("now()", "now() - interval '1 day'", 1)
        _sql(insert + row + ", " + earlier, [instance.pk, None, MISSING, None])
    with pytest.raises(IntegrityError, match="ledger transaction .* does not exist"), transaction.atomic():
        _sql(insert + row, [instance.pk, MISSING])
    assert not UsageInterval.objects.exists()


def test_an_account_with_entries_or_an_instance_with_intervals_cannot_be_deleted_or_renumbered(clock):
    txn, wallet, promo = _posted()
    renter = UserFactory()
    fund(renter, "100")
    instance = running(renter, node())
    clock.advance(30)
    usage_meter()
    for sql, pk in [("DELETE FROM billing_account WHERE id = %s", wallet.pk),
                    ("UPDATE billing_account SET id = -id WHERE id = %s", promo.pk),
                    ("DELETE FROM marketplace_instance WHERE id = %s", instance.pk),
                    ("UPDATE marketplace_instance SET id = -id WHERE id = %s", instance.pk)]:
        with pytest.raises(IntegrityError, match="is referenced by the ledger"), transaction.atomic():
            _sql(sql, [pk])
    empty = user_account(user_id=UserFactory().pk, kind=AccountKind.CUSTOMER_WALLET)
    _sql("DELETE FROM billing_account WHERE id = %s", [empty.pk])  # nothing names it: allowed, as before
    _sql("UPDATE marketplace_instance SET status_message = 'x' WHERE id = %s", [instance.pk])  # other columns: free


def test_a_set_based_insert_with_one_transaction_short_of_entries_cannot_commit():
    _, wallet, promo = _posted()
    with pytest.raises(DatabaseError, match="at least two entries"), transaction.atomic():
        ids = [r[0] for r in _sql(
            "INSERT INTO billing_ledgertransaction (idempotency_key, kind, memo, reason, created_at) "
            "SELECT 'set:' || g, 'credit', '', '', now() FROM generate_series(1, 3) g RETURNING id")]
        _sql("INSERT INTO billing_entry (transaction_id, account_id, amount_micros) "
             "SELECT t, %s, 1 FROM unnest(%s::bigint[]) t UNION ALL SELECT t, %s, -1 FROM unnest(%s::bigint[]) t",
             [wallet.pk, ids[:2], promo.pk, ids[:2]])
        _sql("SET CONSTRAINTS ALL IMMEDIATE")  # what COMMIT does with the deferred check
    _sql("SET CONSTRAINTS ALL DEFERRED")
    assert not LedgerTransaction.objects.filter(idempotency_key__startswith="set:").exists()


def test_billing_twice_from_the_same_start_is_refused_whatever_the_instance_row_says(clock):
    """One interval per instance and start, one usage charge per key: even if the instance's billed_until were
    wound back, the tick fails and writes nothing rather than charge the same seconds again."""
    renter = UserFactory()
    fund(renter, "100")
    instance = running(renter, node())
    clock.advance(60)
    assert usage_meter().intervals == 1
    txns = LedgerTransaction.objects.count()
    saved = Instance.objects.filter(pk=instance.pk).values("billed_until", "billed_seconds", "cost_micros").get()
    Instance.objects.filter(pk=instance.pk).update(billed_until=None, billed_seconds=0, cost_micros=0)
    with pytest.raises(IntegrityError), transaction.atomic():
        usage_meter()
    assert UsageInterval.objects.count() == 1 and LedgerTransaction.objects.count() == txns
    Instance.objects.filter(pk=instance.pk).update(**saved)


@pytest.mark.django_db(transaction=True)
def test_at_commit_the_check_runs_once_per_statement_and_leaves_nothing_behind():
    _, wallet, promo = _posted()
    with pytest.raises(DatabaseError, match="at least two entries"), transaction.atomic():
        _new_txn("lonely")
    assert not LedgerTransaction.objects.filter(idempotency_key="lonely").exists()
    assert _sql("SELECT count(*) FROM billing_ledger_pending") == [(0,)]


@pytest.mark.django_db(transaction=True)
def test_an_account_being_posted_to_cannot_be_deleted_until_the_posting_ends():
    """The per-statement check locks the accounts it names (FOR KEY SHARE), as a foreign key does: a delete of
    an account without committed entries waits for the posting (here: gives up waiting), and once the posting
    has committed, finds its entries and is refused."""
    user = UserFactory()
    wallet, promo = user_account(user_id=user.pk, kind=AccountKind.CUSTOMER_WALLET), \
        platform_account(kind=AccountKind.PROMOTIONS)
    posted, release = threading.Event(), threading.Event()

    def poster():  # raw SQL, so that the only lock on the wallet is the one the check takes
        try:
            with transaction.atomic():
                txn = _new_txn("held")
                _sql("INSERT INTO billing_entry (transaction_id, account_id, amount_micros) "
                     "VALUES (%s, %s, 3), (%s, %s, -3)", [txn, wallet.pk, txn, promo.pk])
                posted.set()
                release.wait(10)
                for account, delta in ((wallet, 3), (promo, -3)):
                    _sql("UPDATE billing_account SET balance_micros = balance_micros + %s WHERE id = %s",
                         [delta, account.pk])
        finally:
            connection.close()

    t = threading.Thread(target=poster)
    t.start()
    assert posted.wait(10)
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("SET lock_timeout = '300ms'")
            with pytest.raises(OperationalError, match="lock timeout"):
                cursor.execute("DELETE FROM billing_account WHERE id = %s", [wallet.pk])
            release.set()
            t.join(10)
            cursor.execute("SET lock_timeout = 0")
            with pytest.raises(IntegrityError, match="is referenced by the ledger"):
                cursor.execute("DELETE FROM billing_account WHERE id = %s", [wallet.pk])
    finally:
        release.set()
        other.close()
    assert LedgerTransaction.objects.filter(idempotency_key="held").exists()


class _RolledBack(Exception):
    pass


@pytest.mark.django_db(transaction=True)
def test_an_instance_being_billed_cannot_be_deleted_until_the_interval_is_written_or_gone(clock):
    """The interval check locks its instances FOR KEY SHARE as a foreign key does: a concurrent delete waits."""
    renter = UserFactory()
    fund(renter, "100")
    instance = running(renter, node())
    inserted, release = threading.Event(), threading.Event()

    def biller():  # raw SQL and no row lock of its own: the only lock on the instance is the check's
        try:
            with transaction.atomic():
                _sql("INSERT INTO billing_usageinterval (instance_id, started_at, ended_at, seconds, "
                     "price_per_hour_micros, platform_fee_bps, amount_micros, fee_micros, transaction_id, created_at) "
                     "VALUES (%s, now(), now() + interval '1 second', 1, 1000, 1500, 0, 0, NULL, now())", [instance.pk])
                inserted.set()
                release.wait(10)
                raise _RolledBack
        except _RolledBack:
            pass
        finally:
            connection.close()

    t = threading.Thread(target=biller)
    t.start()
    assert inserted.wait(10)
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("SET lock_timeout = '300ms'")
            with pytest.raises(OperationalError, match="lock timeout"):
                cursor.execute("DELETE FROM marketplace_instance WHERE id = %s", [instance.pk])
    finally:
        release.set()
        t.join(10)
        other.close()
    assert not UsageInterval.objects.exists()
