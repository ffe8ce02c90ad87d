"""A chargeback or a refund made in Stripe's dashboard that arrives while the top-up it is about (its charge's answer
lost) is being credited, by payment_intent.succeeded or by the per-minute follow-up (reconcile.top_ups_find_lost).

Found by review: top_up_for looked the top-up up by its PaymentIntent (none recorded before the credit), then read
it again without a lock to see whether it was still awaiting its credit. A credit committed between the two reads
had the event ignored for good ("paid no top-up here"): the renter kept the money the bank took back. The second
read now locks the top-up and takes it when its credit has come.
"""
import threading
import time

import pytest
from django.db import connection, transaction

from billing.models import StripeEvent, StripeEventStatus, TopUp, TopUpStatus
from billing.services import charges, webhooks
from billing.services.webhooks import payment_intent_apply
from tests.billing.helpers import balance
from tests.billing.test_payments import deliver
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db(transaction=True)


def _lost_top_up():
    user = UserFactory()
    top_up = TopUp.objects.create(user=user, amount_micros=20_000_000, status=TopUpStatus.FAILED,
                                  outcome_unknown=True)
    intent = {"id": "pi_lost", "object": "payment_intent", "currency": "usd", "amount": 2000, "status": "succeeded",
              "metadata": {"top_up_id": str(top_up.pk), "user_id": str(user.pk)}, "latest_charge": "ch_lost"}
    return user, top_up, intent


def _credit_thread(intent):
    """payment_intent.succeeded's credit (the follow-up's too), in a transaction of its own connection."""
    def credit():
        try:
            with transaction.atomic():
                payment_intent_apply(intent=intent, succeeded=True)
        finally:
            connection.close()
    return threading.Thread(target=credit)


DISPUTE = {"id": "evt_race", "object": "event", "type": "charge.dispute.created", "created": int(time.time()),
           "data": {"object": {"id": "dp_race", "object": "dispute", "amount": 2000, "currency": "usd",
                               "charge": "ch_lost", "payment_intent": "pi_lost", "status": "needs_response",
                               "reason": "fraudulent"}}}
DASHBOARD_REFUND = {"id": "evt_race", "object": "event", "type": "refund.created", "created": int(time.time()),
                    "data": {"object": {"id": "re_race", "object": "refund", "amount": 2000, "currency": "usd",
                                        "charge": "ch_lost", "payment_intent": "pi_lost", "status": "succeeded",
                                        "metadata": {}}}}


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


@pytest.mark.parametrize("event", [DISPUTE, DASHBOARD_REFUND], ids=["chargeback", "dashboard_refund"])
def test_an_event_racing_the_lost_top_ups_credit_is_applied_not_ignored_for_good(monkeypatch, anon, event):
    user, top_up, intent = _lost_top_up()
    monkeypatch.setattr(charges, "_intent_top_up", lambda intent_id: top_up.pk)
    real_lookups, forced = webhooks.stripe_lookups, []

    def credit_commits_meanwhile():
        # The credit locks the top-up first, nothing the event's transaction holds at this point: it commits.
        thread = _credit_thread(intent)
        thread.start()
        thread.join(20)
        assert not thread.is_alive()

    def lookups(**kwargs):
        looked = real_lookups(**kwargs)
        if not forced and looked.top_ups:
            looked.top_ups = _CreditFirst(looked.top_ups, credit_commits_meanwhile)
            forced.append(looked.top_ups)
        return looked

    monkeypatch.setattr(webhooks, "stripe_lookups", lookups)
    deliver(anon, event)
    assert forced and forced[0].raced
    top_up.refresh_from_db()
    assert top_up.status == TopUpStatus.SUCCEEDED and top_up.payment_intent_id == "pi_lost"
    stored = StripeEvent.objects.get(event_id="evt_race")
    assert stored.status == StripeEventStatus.PROCESSED, stored.error  # was: ignored, "paid no top-up here"
    assert balance(user) == 0  # credited $20, and the $20 the bank or the dashboard took back debited
    deliver(anon, event)  # Stripe's next delivery changes nothing
    assert balance(user) == 0


def test_an_event_before_the_credit_still_fails_and_the_credit_applies_it(monkeypatch, anon):
    """Not credited when the event locks the top-up: the event fails, and the credit (its charge_events_retry)
    processes it once committed."""
    user, top_up, intent = _lost_top_up()
    monkeypatch.setattr(charges, "_intent_top_up", lambda intent_id: top_up.pk)
    deliver(anon, DISPUTE)
    stored = StripeEvent.objects.get(event_id="evt_race")
    assert stored.status == StripeEventStatus.FAILED and "not credited yet" in stored.error
    thread = _credit_thread(intent)
    thread.start()
    thread.join(20)
    assert not thread.is_alive()
    stored.refresh_from_db()
    assert stored.status == StripeEventStatus.PROCESSED, stored.error
    assert balance(user) == 0


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


def _until_done_or_waiting_on_a_lock(thread, timeout=20.0):
    """Wait (on the caller's connection, in its transaction) until `thread` ends or another session of this database
    waits for a lock (the caller's, presumably)."""
    deadline = time.monotonic() + timeout
    with connection.cursor() as cursor:
        while thread.is_alive() and time.monotonic() < deadline:
            cursor.execute("SELECT pg_stat_clear_snapshot()")  # else the view stays as this transaction first read it
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                           "AND datname = current_database() AND pid <> pg_backend_pid()")
            if cursor.fetchone()[0]:
                return
            thread.join(0.05)


@pytest.mark.xfail(strict=True, reason=(
    "open: a lock taken in top_up_for is released when the handler's savepoint rolls back (the event failing), not "
    "when the event's FAILED status commits; the credit's charge_events_retry (billing/services/webhooks.py) reads "
    "only FAILED events, so it misses one still being processed. Needs the retry to take up such events too"))
def test_a_credit_committing_before_the_events_failure_commits_still_processes_it(monkeypatch, anon):
    """The event found the top-up not credited and is failing; the credit commits (and runs its charge_events_retry)
    before the event's FAILED status is committed. The event must not be left failed, its debit waiting for Stripe's
    next delivery (hours)."""
    user, top_up, intent = _lost_top_up()
    monkeypatch.setattr(charges, "_intent_top_up", lambda intent_id: top_up.pk)
    real, threads = StripeEvent.transition_to, []

    def failing(self, target):
        if target == StripeEventStatus.FAILED and self.event_id == "evt_race" and not threads:
            threads.append(_credit_thread(intent))
            threads[0].start()
            _until_done_or_waiting_on_a_lock(threads[0])
        return real(self, target)

    monkeypatch.setattr(StripeEvent, "transition_to", failing)
    deliver(anon, DISPUTE)
    assert threads
    threads[0].join(20)
    assert not threads[0].is_alive()
    top_up.refresh_from_db()
    assert top_up.status == TopUpStatus.SUCCEEDED
    stored = StripeEvent.objects.get(event_id="evt_race")
    assert stored.status == StripeEventStatus.PROCESSED, stored.error
    assert balance(user) == 0
