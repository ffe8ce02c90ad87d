"""Refund paths lock every account a refund can touch in one step, in id order (found by review).

ledger_post locks the accounts of one posting in id order, but a transaction that posts twice locked the second
posting's accounts after holding the first's: charge.refunded settling a held refund (refunds pending → payment
clearing) then recording one made in Stripe's dashboard (wallet → payment clearing), or giving a hold back (wallet,
refunds pending) then debiting the wallet for a dashboard refund (wallet, payment clearing). Another transaction
locking the same accounts in id order (an operator's refund of another top-up: wallet, refunds pending; another
customer's held refund made: payment clearing, refunds pending; a top-up credited: payment clearing, wallet) waited
for the first while holding what it wanted next: PostgreSQL aborted one ("deadlock detected ... while locking tuple
in relation billing_account", a 500 from the refunds API, a failed webhook). Now every refund path locks the
customer's wallet, payment clearing and refunds pending in one id-sorted step right after the top-up's lock.

Against PostgreSQL, two threads: the first is paused after its first refund (events, not sleeps), the second runs
into its locks, the first goes on. Each thread's connection has a lock_timeout, so that a regression fails here
(deadlock detected, or the lock timeout) rather than hangs.
"""
import threading
import time
from collections.abc import Callable

import pytest
from django.db import connection, connections, transaction

from billing.models import AccountKind, Refund, RefundStatus, TopUp, TopUpStatus
from billing.services import refunds
from billing.services.ledger import platform_account, user_account
from billing.services.refunds import _refund_reserve, charge_refunded_apply, refund_confirm
from billing.services.top_ups import top_up_credit
from tests.billing.helpers import balance
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db(transaction=True)
WAIT_S = 20  # the longest any event or join is waited for: reached only when something is wrong


def _credited(user, intent: str, amount_micros: int = 40_000_000) -> TopUp:
    top_up = TopUp.objects.create(user=user, amount_micros=amount_micros, status=TopUpStatus.PROCESSING,
                                  payment_intent_id=intent)
    with transaction.atomic():
        top_up_credit(top_up_id=top_up.pk, payment_intent_id=intent, amount_micros=amount_micros)
    top_up.refresh_from_db()
    return top_up


def _reserve(top_up: TopUp, amount_micros: int) -> Refund:
    return _refund_reserve(top_up=top_up, amount_micros=amount_micros, reason="customer asked",
                           created_by=UserFactory(is_staff=True), customer_note="", idempotency_key="",
                           request_fingerprint="")


def _charge(top_up: TopUp, stripe_refunds: list[dict]) -> dict:
    """charge.refunded's charge as API versions before 2022-11-15 send it: its refunds listed."""
    return {"id": f"ch_{top_up.pk}", "object": "charge", "currency": "usd", "payment_intent": top_up.payment_intent_id,
            "refunds": {"object": "list", "data": stripe_refunds, "has_more": False}}


def _stripe_refund(refund_id: str, cents: int, status: str, intent: str, ours: Refund | None = None) -> dict:
    return {"id": refund_id, "object": "refund", "amount": cents, "currency": "usd", "status": status,
            "payment_intent": intent, "metadata": {"refund_id": str(ours.pk)} if ours else {}, "reason": None}


def _production_order() -> None:
    """The platform's accounts as a live system has them: payment clearing long before this customer's wallet (the
    first top-up ever), refunds pending after every wallet made before the holds (migration 0017)."""
    platform_account(kind=AccountKind.PAYMENT_CLEARING)


def _race(monkeypatch, charge: dict, second: Callable[[], object]) -> dict[str, str]:
    """The reviewer's run: the first thread applies charge.refunded (in a transaction, as the webhook does) and is
    paused after its first refund; the second runs `second` in a transaction of its own until it waits for a lock;
    then the first goes on. The errors of each, by name."""
    paused, go = threading.Event(), threading.Event()
    real_apply = refunds.stripe_refund_apply
    applied = []

    def apply_then_pause(**kwargs):
        result = real_apply(**kwargs)
        applied.append(kwargs["stripe_refund"]["id"])
        if len(applied) == 1:
            paused.set()
            go.wait(WAIT_S)
        return result

    monkeypatch.setattr(refunds, "stripe_refund_apply", apply_then_pause)
    errors: dict[str, str] = {}

    def in_thread(name: str, work: Callable[[], object]) -> Callable[[], None]:
        def target() -> None:
            try:
                with connection.cursor() as cursor:  # a regression fails here instead of hanging
                    cursor.execute("SET lock_timeout = '10s'")
                with transaction.atomic():
                    work()
            except BaseException as exc:  # noqa: BLE001 (reported below)
                errors[name] = f"{type(exc).__name__}: {exc}"
            finally:
                connection.close()
        return target

    first = threading.Thread(target=in_thread("charge.refunded", lambda: charge_refunded_apply(charge=charge)))
    second_thread = threading.Thread(target=in_thread("second", second))
    try:
        first.start()
        assert paused.wait(WAIT_S), errors
        second_thread.start()
        _until_a_backend_waits_for_a_lock()
    finally:
        go.set()
        first.join(WAIT_S)
        second_thread.join(WAIT_S)
    assert not first.is_alive() and not second_thread.is_alive()
    return errors


def _until_a_backend_waits_for_a_lock() -> None:
    """Until the second thread waits for a lock the first holds (or a while passes: then the first goes on all the
    same, and the test still checks that both finished)."""
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


def test_a_held_refund_made_then_a_dashboard_refund_vs_an_operator_refund_of_another_top_up(monkeypatch):
    """The reviewer's reproduction: re_A (held) made, re_B (made in Stripe's dashboard) of the same charge in one
    charge.refunded; meanwhile an operator refunds the customer's other top-up."""
    _production_order()
    customer = UserFactory()
    first, second = _credited(customer, "pi_first"), _credited(customer, "pi_second")  # $80
    held = _reserve(first, 15_000_000)
    charge = _charge(first, [_stripe_refund("re_A", 1_500, "succeeded", "pi_first", ours=held),
                             _stripe_refund("re_B", 1_000, "succeeded", "pi_first")])
    assert user_account(user_id=customer.pk, kind=AccountKind.CUSTOMER_WALLET).pk \
        < platform_account(kind=AccountKind.REFUNDS_PENDING).pk

    errors = _race(monkeypatch, charge, lambda: _reserve(second, 20_000_000))

    assert not errors, errors
    held.refresh_from_db()
    assert held.status == RefundStatus.SUCCEEDED and held.stripe_refund_id == "re_A"
    assert Refund.objects.get(stripe_refund_id="re_B").status == RefundStatus.SUCCEEDED
    assert Refund.objects.get(top_up=second).status == RefundStatus.PENDING
    assert balance(customer) == 80_000_000 - 15_000_000 - 10_000_000 - 20_000_000


def test_a_hold_given_back_then_a_dashboard_refund_vs_another_customers_held_refund_made(monkeypatch):
    """Across customers: re_A (held) failed, its hold given back (wallet, refunds pending), then re_B debited
    (wallet, payment clearing); meanwhile another customer's held refund is made (payment clearing, refunds
    pending)."""
    _production_order()
    customer, other = UserFactory(), UserFactory()
    first = _credited(customer, "pi_first")
    others = _credited(other, "pi_other")
    held = _reserve(first, 15_000_000)
    other_held = _reserve(others, 5_000_000)
    charge = _charge(first, [_stripe_refund("re_A", 1_500, "failed", "pi_first", ours=held),
                             _stripe_refund("re_B", 1_000, "succeeded", "pi_first")])

    errors = _race(monkeypatch, charge, lambda: refund_confirm(refund_id=other_held.pk, stripe_refund_id="re_other"))

    assert not errors, errors
    held.refresh_from_db()
    other_held.refresh_from_db()
    assert held.status == RefundStatus.FAILED and other_held.status == RefundStatus.SUCCEEDED
    assert balance(customer) == 40_000_000 - 10_000_000 and balance(other) == 35_000_000


def test_a_hold_given_back_then_a_dashboard_refund_vs_a_top_up_credited(monkeypatch):
    """The same charge.refunded while another top-up of the customer is credited (payment clearing, then the
    wallet, in id order)."""
    _production_order()
    customer = UserFactory()
    first = _credited(customer, "pi_first")
    held = _reserve(first, 15_000_000)
    later = TopUp.objects.create(user=customer, amount_micros=25_000_000, status=TopUpStatus.PROCESSING,
                                 payment_intent_id="pi_later")
    charge = _charge(first, [_stripe_refund("re_A", 1_500, "canceled", "pi_first", ours=held),
                             _stripe_refund("re_B", 1_000, "succeeded", "pi_first")])
    assert platform_account(kind=AccountKind.PAYMENT_CLEARING).pk \
        < user_account(user_id=customer.pk, kind=AccountKind.CUSTOMER_WALLET).pk

    errors = _race(monkeypatch, charge, lambda: top_up_credit(top_up_id=later.pk, payment_intent_id="pi_later",
                                                      amount_micros=25_000_000))

    assert not errors, errors
    held.refresh_from_db()
    assert held.status == RefundStatus.FAILED
    assert TopUp.objects.get(pk=later.pk).status == TopUpStatus.SUCCEEDED
    assert balance(customer) == 40_000_000 - 10_000_000 + 25_000_000
