"""A chargeback or a refund made in Stripe's dashboard that arrives while the top-up it is about (its charge's answer
lost) is being credited, by payment_intent.succeeded or by the per-minute follow-up (reconcile.top_ups_find_lost).

Found by review: top_up_for looked the top-up up by its PaymentIntent (none recorded before the credit), then read
it again without a lock to see whether it was still awaiting its credit. A credit committed between the two reads
had the event ignored for good ("paid no top-up here"): the renter kept the money the bank took back. The second
read now locks the top-up and takes it when its credit has come.

Found by review too: that lock is released when the handler's savepoint rolls back (the event failing), before the
event's FAILED status commits; a credit committing in between ran its charge_events_retry, which took only FAILED
events, and missed this one. The retry now takes every event not processed or ignored yet, and waits for its row.

Each side runs as production runs it: the event's handler on the test's thread (the webhook request), the credit on
a thread and a database connection of its own, in a transaction, its charge_events_retry once that commits. Every
connection gives up on a lock (and a statement) after a while, and every thread is joined with a timeout: a
regression fails here rather than hangs.
"""
import threading
import time
from collections.abc import Callable

import pytest
from django.db import DatabaseError, connection, transaction
from django.db.backends.signals import connection_created

from billing.models import (
    Entry,
    LedgerTransaction,
    StripeEvent,
    StripeEventStatus,
    TopUp,
    TopUpStatus,
    TransactionKind,
)
from billing.services import charges, webhooks
from billing.services.charges import charge_remember
from billing.services.top_ups import top_up_credit
from billing.services.webhooks import charge_events_retry, payment_intent_apply, stripe_event_process
from tests.billing.helpers import balance
from tests.billing.test_payments import deliver
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db(transaction=True)
WAIT_S = 30  # the longest any thread is waited for: reached only when something is wrong
LIMITS = "SET lock_timeout = '20s'; SET statement_timeout = '25s'"  # under WAIT_S: a lock waited for fails first


def _limited(sender, connection, **kwargs):
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(LIMITS)


@pytest.fixture(autouse=True)
def _no_hang(transactional_db):
    """Every connection of the test (its own, the threads') gives up on a lock or a statement before WAIT_S."""
    connection_created.connect(_limited, dispatch_uid="charge-event-credit-race")
    with connection.cursor() as cursor:
        cursor.execute(LIMITS)
    try:
        yield
    finally:
        connection_created.disconnect(dispatch_uid="charge-event-credit-race")
        with connection.cursor() as cursor:
            cursor.execute("RESET lock_timeout; RESET statement_timeout")


def _lost_top_up():
    user = UserFactory()
    top_up = TopUp.objects.create(user=user, amount_micros=20_000_000, status=TopUpStatus.FAILED,
                                  outcome_unknown=True)
    intent = {"id": "pi_lost", "object": "payment_intent", "currency": "usd", "amount": 2000, "status": "succeeded",
              "metadata": {"top_up_id": str(top_up.pk), "user_id": str(user.pk)}, "latest_charge": "ch_lost"}
    return user, top_up, intent


class _Worker:
    """`work` on a thread and a database connection of its own, as another worker (a webhook request, a Celery task)
    runs it; what it raised kept for the test."""

    def __init__(self, work: Callable[[], object]):
        self.errors: list[str] = []
        self.results: list[object] = []
        self.thread = threading.Thread(target=self._run, args=(work,))

    def _run(self, work: Callable[[], object]) -> None:
        try:
            self.results.append(work())
        except BaseException as exc:  # noqa: BLE001 (asserted by join)
            self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            connection.close()

    def start(self) -> None:
        self.thread.start()

    def join(self) -> None:
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "still running: blocked?"
        assert not self.errors, self.errors


class _Credit(_Worker):
    """payment_intent.succeeded's credit (the follow-up's too): in a transaction of its own, and once committed, its
    charge_events_retry (on commit, on the same thread)."""

    def __init__(self, monkeypatch, intent):
        def credit():
            with transaction.atomic():
                payment_intent_apply(intent=intent, succeeded=True)

        super().__init__(credit)
        self.committed, self.retried = threading.Event(), []
        real = webhooks.charge_events_retry

        def retry(**kwargs):
            self.committed.set()  # run on commit: the credit is committed
            self.retried.append(real(**kwargs))
            return self.retried[-1]

        monkeypatch.setattr(webhooks, "charge_events_retry", retry)

    def until_committed(self) -> None:
        deadline = time.monotonic() + WAIT_S
        while not self.committed.wait(0.05) and self.thread.is_alive() and time.monotonic() < deadline:
            pass
        assert self.committed.is_set(), self.errors or "the credit did not commit"


def _until_done_or_waiting_on_a_lock(thread, timeout=20.0) -> bool:
    """Wait (on the caller's connection, in its transaction if any) until `thread` ends or another session of this
    database waits for a lock (the caller's, presumably); whether one did."""
    deadline = time.monotonic() + timeout
    with connection.cursor() as cursor:
        while thread.is_alive() and time.monotonic() < deadline:
            cursor.execute("SELECT pg_stat_clear_snapshot()")  # else the view stays as this transaction first read it
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                           "AND datname = current_database() AND pid <> pg_backend_pid()")
            if cursor.fetchone()[0]:
                return True
            thread.join(0.05)
    return False


def _debits(user) -> int:
    """The ledger transactions that took the top-up's money back from the user's wallet (a chargeback, a refund)."""
    wallet = Entry.objects.filter(account__user=user, amount_micros__lt=0).values("transaction_id")
    return LedgerTransaction.objects.filter(pk__in=wallet, kind__in=[TransactionKind.CHARGEBACK,
                                                                     TransactionKind.REFUND]).count()


DISPUTE = {"id": "evt_race", "object": "event", "type": "charge.dispute.created", "created": int(time.time()),
           "data": {"object": {"id": "dp_race", "object": "dispute", "amount": 2000, "currency": "usd",
                               "charge": "ch_lost", "payment_intent": "pi_lost", "status": "needs_response",
                               "reason": "fraudulent"}}}
DASHBOARD_REFUND = {"id": "evt_race", "object": "event", "type": "refund.created", "created": int(time.time()),
                    "data": {"object": {"id": "re_race", "object": "refund", "amount": 2000, "currency": "usd",
                                        "charge": "ch_lost", "payment_intent": "pi_lost", "status": "succeeded",
                                        "metadata": {}}}}
EVENTS = pytest.mark.parametrize("event", [DISPUTE, DASHBOARD_REFUND], ids=["chargeback", "dashboard_refund"])


class _CreditFirst(dict):
    """`looked.top_ups` (which top-up a PaymentIntent no top-up recorded was made for): top_up_for reads it right
    after it found no top-up by the PaymentIntent, and before it reads that top-up again; the first read lets the
    credit commit there, the race forced."""

    def __init__(self, answers, credit):
        super().__init__(answers)
        self.credit, self.raced = credit, False

    def get(self, key, default=None):
        if not self.raced:
            self.raced = True
            self.credit()
        return super().get(key, default)


@EVENTS
def test_an_event_racing_the_lost_top_ups_credit_is_applied_not_ignored_for_good(monkeypatch, anon, event):
    user, top_up, intent = _lost_top_up()
    monkeypatch.setattr(charges, "_intent_top_up", lambda intent_id: top_up.pk)
    credit = _Credit(monkeypatch, intent)
    real_lookups, forced = webhooks.stripe_lookups, []

    def credit_commits_meanwhile():
        # The credit locks the top-up first, nothing the event's transaction holds at this point: it commits. Its
        # charge_events_retry then takes the event (not processed yet) and waits for its row, which this holds.
        credit.start()
        credit.until_committed()
        _until_done_or_waiting_on_a_lock(credit.thread)

    def lookups(**kwargs):
        looked = real_lookups(**kwargs)
        if not forced and looked.top_ups:
            looked.top_ups = _CreditFirst(looked.top_ups, credit_commits_meanwhile)
            forced.append(looked.top_ups)
        return looked

    monkeypatch.setattr(webhooks, "stripe_lookups", lookups)
    deliver(anon, event)
    credit.join()  # the event's transaction committed: the retry found the event processed, and left it so
    assert forced and forced[0].raced
    top_up.refresh_from_db()
    assert top_up.status == TopUpStatus.SUCCEEDED and top_up.payment_intent_id == "pi_lost"
    stored = StripeEvent.objects.get(event_id="evt_race")
    assert stored.status == StripeEventStatus.PROCESSED, stored.error  # was: ignored, "paid no top-up here"
    assert balance(user) == 0  # credited $20, and the $20 the bank or the dashboard took back debited
    assert _debits(user) == 1
    deliver(anon, event)  # Stripe's next delivery changes nothing
    assert balance(user) == 0 and _debits(user) == 1


def test_an_event_before_the_credit_still_fails_and_the_credit_applies_it(monkeypatch, anon):
    """Not credited when the event locks the top-up: the event fails, and the credit (its charge_events_retry)
    processes it once committed."""
    user, top_up, intent = _lost_top_up()
    monkeypatch.setattr(charges, "_intent_top_up", lambda intent_id: top_up.pk)
    deliver(anon, DISPUTE)
    stored = StripeEvent.objects.get(event_id="evt_race")
    assert stored.status == StripeEventStatus.FAILED and "not credited yet" in stored.error
    credit = _Credit(monkeypatch, intent)
    credit.start()
    credit.join()
    assert credit.retried == [1]
    stored.refresh_from_db()
    assert stored.status == StripeEventStatus.PROCESSED, stored.error
    assert balance(user) == 0 and _debits(user) == 1


def test_a_top_up_credited_by_another_payment_is_not_matched(monkeypatch, anon):
    """The locked read takes the top-up only when this PaymentIntent credited it."""
    user, top_up, intent = _lost_top_up()
    monkeypatch.setattr(charges, "_intent_top_up", lambda intent_id: top_up.pk)
    real_lookups = webhooks.stripe_lookups

    def lookups(**kwargs):
        looked = real_lookups(**kwargs)
        with transaction.atomic():  # credited meanwhile, by another payment made for it
            payment_intent_apply(intent={**intent, "id": "pi_other", "latest_charge": "ch_other"}, succeeded=True)
        return looked

    monkeypatch.setattr(webhooks, "stripe_lookups", lookups)
    deliver(anon, DISPUTE)
    top_up.refresh_from_db()
    assert top_up.status == TopUpStatus.SUCCEEDED and top_up.payment_intent_id == "pi_other"
    stored = StripeEvent.objects.get(event_id="evt_race")
    assert stored.status == StripeEventStatus.IGNORED and "paid no top-up here" in stored.error
    assert balance(user) == 20_000_000


@EVENTS
def test_a_credit_committing_before_the_events_failure_commits_still_processes_it(monkeypatch, anon, event):
    """The event found the top-up not credited and is failing (its savepoint rolled back, the top-up's lock with
    it); the credit commits, and runs its charge_events_retry, before the event's FAILED status is committed. The
    event must not be left failed, its debit waiting for Stripe's next delivery (hours): the retry waits for the
    event's row and processes it once the failure is committed. (Found by review: the retry took only FAILED
    events, and this one was not yet.)"""
    user, top_up, intent = _lost_top_up()
    monkeypatch.setattr(charges, "_intent_top_up", lambda intent_id: top_up.pk)
    credit = _Credit(monkeypatch, intent)
    real = StripeEvent.transition_to

    def failing(self, target):
        if target == StripeEventStatus.FAILED and self.event_id == "evt_race" and not credit.thread.ident:
            credit.start()
            credit.until_committed()
            _until_done_or_waiting_on_a_lock(credit.thread)
        return real(self, target)

    monkeypatch.setattr(StripeEvent, "transition_to", failing)
    response = deliver(anon, event)
    assert response.status_code == 500  # failed: the top-up was not credited when the handler locked it
    assert credit.thread.ident, "the event did not fail"
    credit.join()  # the event's failure committed; the retry, waiting for its row, processed it then
    top_up.refresh_from_db()
    assert top_up.status == TopUpStatus.SUCCEEDED
    stored = StripeEvent.objects.get(event_id="evt_race")
    assert stored.status == StripeEventStatus.PROCESSED, stored.error
    assert credit.retried == [1]
    assert balance(user) == 0 and _debits(user) == 1
    deliver(anon, event)  # Stripe's next delivery changes nothing
    assert balance(user) == 0 and _debits(user) == 1


def _credited_top_up():
    user = UserFactory()
    top_up = TopUp.objects.create(user=user, amount_micros=20_000_000, status=TopUpStatus.PROCESSING,
                                  payment_intent_id="pi_lost")
    with transaction.atomic():
        top_up_credit(top_up_id=top_up.pk, payment_intent_id="pi_lost", amount_micros=20_000_000)
    charge_remember(top_up=top_up, charge_id="ch_lost")
    return user, top_up


@pytest.mark.parametrize("second", ["stripe_delivers_again", "a_credits_retry"])
def test_an_event_being_processed_is_applied_once_by_a_second_worker_taking_it(monkeypatch, second):
    """Another worker takes an event while its handler is applying it: Stripe's next delivery (a delivery that timed
    out at Stripe while it was being processed), or a credit's charge_events_retry, which takes events not processed
    yet. It waits for the event's row, reads its status under that lock, and leaves it processed: debited once."""
    user, top_up = _credited_top_up()
    stored = StripeEvent.objects.create(event_id="evt_race", type=DISPUTE["type"], payload=DISPUTE)
    real_apply, applied, paused, go = webhooks.dispute_apply, [], threading.Event(), threading.Event()

    def apply_then_pause(**kwargs):
        result = real_apply(**kwargs)
        applied.append(kwargs["dispute"]["id"])
        if len(applied) == 1:  # the first applies it, and waits (its transaction open, the event's row locked)
            paused.set()
            go.wait(WAIT_S)
        return result

    monkeypatch.setattr(webhooks, "dispute_apply", apply_then_pause)
    first = _Worker(lambda: stripe_event_process(event_id=stored.pk))
    again = _Worker(lambda: stripe_event_process(event_id=stored.pk) if second == "stripe_delivers_again"
                    else charge_events_retry(top_up_id=top_up.pk))
    first.start()
    try:
        assert paused.wait(WAIT_S), first.errors
        again.start()
        waited = _until_done_or_waiting_on_a_lock(again.thread)
    finally:
        go.set()
        first.join()
        again.join()
    assert waited, "the second worker did not wait for the event's row"
    assert applied == ["dp_race"]
    stored.refresh_from_db()
    assert stored.status == StripeEventStatus.PROCESSED, stored.error
    assert balance(user) == 0 and _debits(user) == 1


def test_the_retry_never_raises_when_it_cannot_read_the_events(caplog):
    """charge_events_retry runs on the credit's commit: a failure to read which events waited for it is logged, not
    raised (the credit is committed; Stripe delivers the events again)."""
    _, top_up = _credited_top_up()
    with transaction.atomic():
        with connection.cursor() as cursor, pytest.raises(DatabaseError):
            cursor.execute("SELECT 1 / 0")  # the transaction aborted: every read after this one fails
        assert charge_events_retry(top_up_id=top_up.pk) == 0
        transaction.set_rollback(True)
    assert "looking for the events that waited for its credit failed" in caplog.text
