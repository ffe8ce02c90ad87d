"""Payouts lock the ledger accounts they post to in one global order (account id), and one provider's database error
does not stop a run for the others.

payout_create locked the provider's earnings row first (select_for_update), then ledger_post locked [earnings,
payout clearing] in id order; _payout_failed's ledger_post locked [clearing, earnings] in id order. When payout
clearing's id is lower than the provider's earnings id (any provider who joined after the first payout ever), the
weekly run's payout_create and a refused transfer's reversal (follow-up / "send again") deadlocked: PostgreSQL
aborted one (found by review). And a database error in one provider's payout escaped payouts_run: every provider
after that one went unpaid that week.
"""
import ast
import logging
import threading
import time
from contextlib import contextmanager
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import pytest
from django.db import connection, connections

from billing.models import AccountKind, Payout, PayoutStatus
from billing.services import payouts
from billing.services.ledger import earnings_balance, platform_account, user_account
from marketplace.services import instances as svc
from tests.billing.helpers import fund, node, running
from tests.billing.test_payouts import MONDAY, ConnectServer, _provider_with_earnings
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db(transaction=True)
WAIT_S = 20
SERVICES = Path(__file__).resolve().parents[2] / "billing" / "services"


@pytest.fixture
def connect(settings):
    server = ConnectServer()
    settings.STRIPE_CONNECT_API_BASE = server.url
    yield server
    server.close()


def _until_a_backend_waits_for_a_lock() -> None:
    watcher = connections.create_connection("default")
    try:
        deadline = time.monotonic() + 5
        with watcher.cursor() as cursor:
            while time.monotonic() < deadline:
                cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                               "AND datname = current_database()")
                if cursor.fetchone()[0]:
                    return
                time.sleep(0.02)
    finally:
        watcher.close()


@contextmanager
def _row_held(table: str, pk: int):
    """Another session holds the row's lock (FOR UPDATE) meanwhile; this one gives up waiting after a second."""
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("BEGIN")
            cursor.execute(f"SELECT id FROM {table} WHERE id = %s FOR UPDATE", [pk])  # noqa: S608 (a model's table)
            with connection.cursor() as mine:
                mine.execute("SET lock_timeout = '1s'")
            try:
                yield
            finally:
                with connection.cursor() as mine:
                    mine.execute("RESET lock_timeout")
                cursor.execute("ROLLBACK")
    finally:
        other.close()


def test_weekly_payout_create_and_a_refused_payouts_reversal_do_not_deadlock(clock, connect, monkeypatch):
    platform_account(kind=AccountKind.PAYOUT_CLEARING)  # production order: the first payout ever was long ago
    provider = _provider_with_earnings(clock)  # $42.50 earned
    assert platform_account(kind=AccountKind.PAYOUT_CLEARING).pk \
        < user_account(user_id=provider.pk, kind=AccountKind.PROVIDER_EARNINGS).pk
    # Last week's payout: reserved, its transfer's answer lost (pending).
    connect.mode = "down"
    old = payouts.payout_create(provider_id=provider.pk, period_start=date(2026, 3, 2), period_end=date(2026, 3, 8))
    payouts.payout_send(payout=old)
    assert Payout.objects.get(pk=old.pk).status == PayoutStatus.PENDING
    # More earnings this week.
    clock.advance(7 * 24 * 3600)
    renter = UserFactory()
    fund(renter, "1000")
    instance = running(renter, node("10.000000", provider=provider))
    clock.advance(5 * 3600)
    svc.instance_stop(instance=instance)
    assert earnings_balance(user_id=provider.pk) == 42_500_000

    # The weekly run's payout_create is paused just after it locked the earnings row.
    paused, go = threading.Event(), threading.Event()
    real_minimum = payouts.payout_minimum_micros

    def minimum_then_pause():
        if threading.current_thread().name == "weekly":
            paused.set()
            go.wait(WAIT_S)
        return real_minimum()

    monkeypatch.setattr(payouts, "payout_minimum_micros", minimum_then_pause)
    connect.mode = "refuse"  # Stripe now refuses last week's transfer: _payout_failed gives the earnings back
    errors: dict[str, str] = {}

    def in_thread(name, work):
        def target():
            try:
                with connection.cursor() as cursor:
                    cursor.execute("SET lock_timeout = '10s'")
                work()
            except BaseException as exc:  # noqa: BLE001
                errors[name] = f"{type(exc).__name__}: {exc}"
            finally:
                connection.close()
        return threading.Thread(target=target, name=name)

    weekly = in_thread("weekly", lambda: payouts.payout_create(
        provider_id=provider.pk, period_start=date(2026, 3, 9), period_end=date(2026, 3, 15)))
    follow_up = in_thread("follow_up", lambda: payouts.payout_send(payout=Payout.objects.get(pk=old.pk)))
    try:
        weekly.start()
        assert paused.wait(WAIT_S), errors
        follow_up.start()
        _until_a_backend_waits_for_a_lock()
    finally:
        go.set()
        weekly.join(WAIT_S)
        follow_up.join(WAIT_S)
    assert not errors, errors  # before: {'follow_up': 'OperationalError: deadlock detected ...'}
    assert Payout.objects.get(pk=old.pk).status == PayoutStatus.FAILED
    new = Payout.objects.get(provider=provider, period_start=date(2026, 3, 9))
    assert new.amount_micros == 42_500_000  # this week's earnings; last week's came back after it was reserved
    assert earnings_balance(user_id=provider.pk) == 42_500_000  # last week's, given back, go with the next payout


def test_payouts_run_goes_on_past_a_provider_whose_payout_fails_with_a_database_error(clock, connect, caplog):
    stuck = _provider_with_earnings(clock, account="acct_1Stuck")  # first in the run (lower id)
    paid = _provider_with_earnings(clock, account="acct_1Paid")
    assert stuck.pk < paid.pk
    stuck_earnings = user_account(user_id=stuck.pk, kind=AccountKind.PROVIDER_EARNINGS)
    with caplog.at_level(logging.ERROR, logger="billing.services.payouts"), \
            _row_held("billing_account", stuck_earnings.pk):  # its payout_create: a lock timeout (a database error)
        done = payouts.payouts_run(today=MONDAY)  # before: OperationalError, and `paid` got nothing
    assert [(p.provider_id, p.status, p.amount_micros) for p in done] == [(paid.pk, "paid", 42_500_000)]
    assert not Payout.objects.filter(provider=stuck).exists()
    assert earnings_balance(user_id=stuck.pk) == 42_500_000  # nothing reserved: it goes with the next run
    assert f"provider {stuck.pk}'s payout was not made" in caplog.text
    assert "1 of the run's payouts failed with a database error" in caplog.text
    # The next run pays it.
    [again] = payouts.payouts_run(today=MONDAY)  # `paid` is due no more (paid out)
    assert (again.provider_id, again.status, again.amount_micros) == (stuck.pk, "paid", 42_500_000)


def test_the_follow_up_goes_on_past_a_payout_whose_send_fails_with_a_database_error(clock, connect, caplog):
    first = _provider_with_earnings(clock, account="acct_1First")
    second = _provider_with_earnings(clock, account="acct_1Second")
    connect.mode = "down"  # both reserved, their answers lost: pending
    stuck, other = payouts.payouts_run(today=MONDAY)
    assert (stuck.provider_id, other.provider_id) == (first.pk, second.pk)
    assert {p.status for p in Payout.objects.all()} == {PayoutStatus.PENDING}
    connect.mode = "ok"
    later = datetime.now(UTC) + timedelta(days=1)
    with caplog.at_level(logging.ERROR, logger="billing.services.payouts"), _row_held("billing_payout", stuck.pk):
        assert payouts.payouts_send_pending(now=later) == 2  # before: OperationalError, `other` not sent
    assert Payout.objects.get(pk=stuck.pk).status == PayoutStatus.PENDING
    assert Payout.objects.get(pk=other.pk).status == PayoutStatus.PAID
    assert f"payout {stuck.pk} of provider {first.pk} was not sent" in caplog.text
    payouts.payouts_send_pending(now=later)
    assert Payout.objects.get(pk=stuck.pk).status == PayoutStatus.PAID


def _account_row_locks(path: Path) -> list[int]:
    """Lines of `path` that lock Account rows with a select_for_update of their own (not ledger's helpers)."""
    lines = []
    for call in ast.walk(ast.parse(path.read_text())):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) \
                and call.func.attr == "select_for_update" and "Account.objects" in ast.unparse(call.func.value):
            lines.append(call.lineno)
    return lines


def test_billing_services_lock_ledger_accounts_only_through_the_ledgers_id_ordered_helpers():
    """Every account lock in billing/services goes through ledger.accounts_lock or ledger_post (one step, id order):
    a select_for_update of one account elsewhere, then a posting to others, is how payouts deadlocked."""
    found = {path.name: lines for path in sorted(SERVICES.glob("*.py"))
             if path.name != "ledger.py" and (lines := _account_row_locks(path))}
    assert found == {}  # before: {'payouts.py': [70], 'refunds.py': [337]}
