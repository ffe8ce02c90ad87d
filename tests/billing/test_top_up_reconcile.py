"""Top-ups whose webhook never comes are settled by asking Stripe (a real localstripe, whose webhooks go nowhere
here): credited once whichever of the webhook and the follow-up comes first, failed when Stripe says so, left
alone while the payment is still under way, and never stopped for good by a Stripe error."""
import json
import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
import stripe as stripe_sdk
from django.db import connection
from django.utils import timezone

from billing import tasks
from billing.models import BillingEvent, Card, LedgerTransaction, StripeEvent, TopUp, TopUpStatus
from billing.services import reconcile
from billing.services.reconcile import top_up_reconcile, top_ups_reconcile
from billing.services.webhooks import webhook_receive
from tests.billing.helpers import balance
from tests.billing.test_payments import deliver, save_card, sign, stripe_client
from tests.factories import UserFactory

AFTER = timedelta(seconds=301)  # past BILLING_TOP_UP_RECONCILE_AFTER_S (300 s by default)


def charge(api, amount="25.00") -> TopUp:
    """A top-up charged at localstripe: Stripe took the money, the webhook is yet to come (and never will)."""
    card = save_card(api)
    response = api.post("/api/v1/billing/top-ups/", {"amount": amount, "card": card["id"]}, format="json")
    assert response.status_code == 202, response.content
    top_up = TopUp.objects.get(pk=response.json()["id"])
    assert top_up.status == TopUpStatus.PROCESSING and top_up.payment_intent_id
    return top_up


def succeeded_event(localstripe, top_up: TopUp) -> dict:
    """The payment_intent.succeeded event Stripe would have sent, with the intent as Stripe has it."""
    intent = stripe_client(localstripe).payment_intents.retrieve(top_up.payment_intent_id)
    return {"id": f"evt_{intent.id}", "object": "event", "type": "payment_intent.succeeded",
            "data": {"object": intent.to_dict()}}


def assert_credited_once(user, top_up: TopUp, amount_micros: int) -> None:
    top_up.refresh_from_db()
    assert top_up.status == TopUpStatus.SUCCEEDED and top_up.transaction_id is not None
    assert balance(user) == amount_micros
    assert LedgerTransaction.objects.filter(kind="top_up", idempotency_key=f"top-up:{top_up.pk}").count() == 1
    assert BillingEvent.objects.filter(user=user, kind="top_up_succeeded").count() == 1


def processing_top_up(user, intent_id: str, amount_micros: int = 25_000_000) -> TopUp:
    card = Card.objects.filter(user=user).first()
    return TopUp.objects.create(user=user, amount_micros=amount_micros, card=card, status=TopUpStatus.PROCESSING,
                                payment_intent_id=intent_id)


@pytest.mark.django_db
def test_a_top_up_whose_webhook_never_comes_is_credited_by_the_follow_up(localstripe, api):
    top_up = charge(api)
    assert top_ups_reconcile() == {}  # within the first minutes the webhook is waited for
    assert top_ups_reconcile(now=timezone.now() + AFTER) == {"succeeded": 1}
    assert_credited_once(api.user, top_up, 25_000_000)
    assert "added to your balance" in BillingEvent.objects.get(user=api.user, kind="top_up_succeeded").message
    assert top_ups_reconcile(now=timezone.now() + 10 * AFTER) == {}  # nothing is processing any more


@pytest.mark.django_db
def test_webhook_first_then_the_follow_up_credits_once(localstripe, api):
    top_up = charge(api)
    assert deliver(api, succeeded_event(localstripe, top_up)).json()["status"] == "processed"
    assert_credited_once(api.user, top_up, 25_000_000)
    assert top_ups_reconcile(now=timezone.now() + AFTER) == {}  # no longer processing
    assert top_up_reconcile(top_up_id=top_up.pk) == "settled"
    assert_credited_once(api.user, top_up, 25_000_000)


@pytest.mark.django_db
def test_the_webhook_landing_while_the_follow_up_asks_stripe_credits_once(localstripe, api, monkeypatch):
    """The follow-up picked the top-up and asked Stripe; the webhook credits meanwhile; the follow-up then applies
    Stripe's answer through the same service, which finds the top-up credited and changes nothing."""
    top_up = charge(api)
    real_client = reconcile.client

    def retrieve(intent_id):
        intent = real_client().v1.payment_intents.retrieve(intent_id)
        assert deliver(api, succeeded_event(localstripe, top_up)).json()["status"] == "processed"
        return intent

    monkeypatch.setattr(reconcile, "client", lambda: SimpleNamespace(
        v1=SimpleNamespace(payment_intents=SimpleNamespace(retrieve=retrieve))))
    assert top_ups_reconcile(now=timezone.now() + AFTER) == {"succeeded": 1}
    assert_credited_once(api.user, top_up, 25_000_000)


@pytest.mark.django_db
def test_follow_up_first_then_the_webhook_credits_once(localstripe, api):
    top_up = charge(api, "40.00")
    assert top_ups_reconcile(now=timezone.now() + AFTER) == {"succeeded": 1}
    assert_credited_once(api.user, top_up, 40_000_000)
    event = succeeded_event(localstripe, top_up)
    response = deliver(api, event)
    assert response.status_code == 200 and response.json()["status"] == "processed"
    assert deliver(api, event).status_code == 200  # and again, as Stripe retries
    assert_credited_once(api.user, top_up, 40_000_000)
    assert StripeEvent.objects.get(event_id=event["id"]).deliveries == 2


def at_once(*fns) -> list[Exception]:
    """Run the functions in threads released together; return what they raised."""
    barrier = threading.Barrier(len(fns))
    errors = []

    def run(fn):
        try:
            barrier.wait(5)
            fn()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(fn,)) for fn in fns]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return errors


@pytest.mark.django_db(transaction=True)
def test_webhook_and_follow_up_at_the_same_moment_credit_once(localstripe, client_for):
    api = client_for(UserFactory())
    top_ups = [charge(api, "10.00") for _ in range(3)]
    for top_up in top_ups:
        body = json.dumps(succeeded_event(localstripe, top_up)).encode()
        errors = at_once(lambda body=body: webhook_receive(payload=body, signature=sign(body)),
                         lambda top_up=top_up: top_up_reconcile(top_up_id=top_up.pk))
        assert not errors, errors
    assert balance(api.user) == 30_000_000
    assert LedgerTransaction.objects.filter(kind="top_up").count() == 3
    assert BillingEvent.objects.filter(user=api.user, kind="top_up_succeeded").count() == 3
    assert set(TopUp.objects.values_list("status", flat=True)) == {TopUpStatus.SUCCEEDED}


@pytest.mark.django_db
def test_a_canceled_or_declined_payment_fails_the_top_up_with_the_usual_event(localstripe, api):
    save_card(api)
    customer = api.user.billing_profile.stripe_customer_id
    stripe = stripe_client(localstripe)
    card = Card.objects.get(user=api.user)
    pending = stripe.payment_intents.create(params={
        "amount": 2500, "currency": "usd", "customer": customer, "payment_method": card.stripe_payment_method_id})
    canceled = processing_top_up(api.user, stripe.payment_intents.cancel(pending.id).id)
    declined_card = save_card(api, "pm_card_chargeCustomerFail")
    refused = stripe.payment_intents.create(params={
        "amount": 2500, "currency": "usd", "customer": customer,
        "payment_method": Card.objects.get(pk=declined_card["id"]).stripe_payment_method_id})
    with pytest.raises(stripe_sdk.CardError):
        stripe.payment_intents.confirm(refused.id)  # the charge fails: back to requires_payment_method
    declined = processing_top_up(api.user, refused.id)

    assert top_ups_reconcile(now=timezone.now() + AFTER) == {"failed": 2}
    canceled.refresh_from_db()
    declined.refresh_from_db()
    assert canceled.status == TopUpStatus.FAILED and canceled.failure_message == "The payment was canceled."
    assert declined.status == TopUpStatus.FAILED and "declined" in declined.failure_message
    events = BillingEvent.objects.filter(user=api.user, kind="top_up_failed")
    assert sorted(e.data["top_up"] for e in events) == sorted([canceled.pk, declined.pk])
    assert balance(api.user) == 0 and not LedgerTransaction.objects.filter(kind="top_up").exists()


@pytest.mark.django_db
def test_a_payment_still_under_way_is_left_alone_and_asked_again_later(localstripe, api):
    save_card(api)
    card = Card.objects.get(user=api.user)
    intent = stripe_client(localstripe).payment_intents.create(params={
        "amount": 2500, "currency": "usd", "customer": api.user.billing_profile.stripe_customer_id,
        "payment_method": card.stripe_payment_method_id})  # not confirmed: Stripe has no outcome yet
    top_up = processing_top_up(api.user, intent.id)
    first = timezone.now() + AFTER
    assert top_ups_reconcile(now=first) == {"processing": 1}
    top_up.refresh_from_db()
    assert top_up.status == TopUpStatus.PROCESSING and top_up.updated_at == first
    assert top_ups_reconcile(now=first + timedelta(minutes=1)) == {}  # not asked every minute
    assert top_ups_reconcile(now=first + AFTER) == {"processing": 1}
    assert balance(api.user) == 0 and not BillingEvent.objects.filter(user=api.user).exists()


@pytest.mark.django_db
def test_stripe_errors_do_not_stop_the_loop_for_good(localstripe, api, settings):
    good = charge(api)
    unknown = processing_top_up(api.user, "pi_unknown_to_stripe")
    mismatched = charge(api, "30.00")
    TopUp.objects.filter(pk=mismatched.pk).update(amount_micros=31_000_000)  # Stripe charged $30 for it
    TopUp.objects.filter(pk=unknown.pk).update(updated_at=timezone.now() - timedelta(hours=1))  # oldest first
    later = timezone.now() + AFTER

    settings.STRIPE_API_BASE = "http://127.0.0.1:9"  # Stripe unreachable: this run ends, nothing changes
    assert top_ups_reconcile(now=later) == {"stripe_unavailable": 1}
    assert set(TopUp.objects.values_list("status", flat=True)) == {TopUpStatus.PROCESSING}

    settings.STRIPE_API_BASE = localstripe.url
    assert top_ups_reconcile(now=later) == {"error": 2, "succeeded": 1}  # a 404 and a mismatch: the rest goes on
    assert_credited_once(api.user, good, 25_000_000)
    for top_up in (unknown, mismatched):
        top_up.refresh_from_db()
        assert top_up.status == TopUpStatus.PROCESSING  # looked up again after the same delay
    assert top_ups_reconcile(now=later + timedelta(minutes=1)) == {}


@pytest.mark.django_db
def test_beat_runs_it_every_minute_one_run_at_a_time(localstripe, api, settings):
    entry = settings.CELERY_BEAT_SCHEDULE["billing-top-ups-reconcile"]
    assert entry["task"] == "billing.tasks.top_ups_reconcile" and entry["schedule"] <= 60
    assert settings.BILLING_TOP_UP_RECONCILE_AFTER_S == 300
    top_up = charge(api)
    settings.BILLING_TOP_UP_RECONCILE_AFTER_S = 0
    from core.locks import advisory_lock

    with advisory_lock("billing.top_ups_reconcile"):
        assert top_ups_reconcile()["skipped"]
    tasks.top_ups_reconcile()
    assert_credited_once(api.user, top_up, 25_000_000)
