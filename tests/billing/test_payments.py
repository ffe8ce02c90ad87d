"""Cards, top-ups, webhooks and refunds against a real localstripe (and the live test server for webhooks)."""
import hashlib
import hmac
import json
import time
from datetime import timedelta

import pytest
import stripe as stripe_sdk
from django.db import transaction

from billing.models import (
    BillingEvent,
    Card,
    LedgerTransaction,
    Refund,
    StripeEvent,
    TopUp,
    TopUpStatus,
)
from billing.services import payments
from billing.services.metering import usage_close
from core.errors import Conflict
from tests.billing.conftest import WEBHOOK_SECRET
from tests.billing.helpers import balance, node, running
from tests.factories import UserFactory

WEBHOOK = "/api/v1/billing/stripe/webhook/"


def sign(body: bytes, secret: str = WEBHOOK_SECRET, at: int | None = None) -> str:
    at = at or int(time.time())
    digest = hmac.new(secret.encode(), f"{at}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={at},v1={digest}"


def deliver(client, event: dict, secret: str = WEBHOOK_SECRET, signature: str | None = None):
    body = json.dumps(event).encode()
    headers = {"HTTP_STRIPE_SIGNATURE": signature if signature is not None else sign(body, secret)}
    return client.post(WEBHOOK, data=body, content_type="application/json", **headers)


def intent_event(event_id: str, kind: str, top_up: TopUp, amount_cents: int | None = None, **intent) -> dict:
    return {
        "id": event_id, "object": "event", "type": kind, "api_version": "2017-08-15", "created": int(time.time()),
        "data": {"object": {
            "id": intent.pop("id", f"pi_{top_up.pk}"), "object": "payment_intent", "currency": "usd",
            "amount": amount_cents if amount_cents is not None else top_up.amount_micros // 10_000,
            "metadata": {"top_up_id": str(top_up.pk)}, **intent,
        }},
    }


def stripe_client(localstripe):
    return stripe_sdk.StripeClient("sk_test_x", base_addresses={"api": localstripe.url}, max_network_retries=0).v1


def save_card(api, payment_method="pm_card_visa") -> dict:
    response = api.post("/api/v1/billing/cards/", {"payment_method": payment_method}, format="json")
    assert response.status_code == 201, response.content
    return response.json()


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


# ---------------------------------------------------------------------------------------------- cards


@pytest.mark.django_db
def test_a_card_is_saved_through_a_setup_intent(localstripe, api, other_api):
    response = api.post("/api/v1/billing/cards/setup-intent/")
    assert response.status_code == 201
    intent = response.json()
    assert intent["client_secret"].startswith(intent["setup_intent"]) and intent["publishable_key"]
    assert response["Cache-Control"] == "no-store"  # a secret for Stripe.js: no cache keeps it
    stripe_client(localstripe).setup_intents.confirm(intent["setup_intent"],
                                                     params={"payment_method": "pm_card_visa"})  # Stripe.js's part
    response = api.post("/api/v1/billing/cards/", {"setup_intent": intent["setup_intent"]}, format="json")
    assert response.status_code == 201, response.content
    card = response.json()
    assert (card["brand"], card["last4"]) == ("visa", "4242")
    again = api.post("/api/v1/billing/cards/", {"setup_intent": intent["setup_intent"]}, format="json")
    assert again.status_code == 200 and again.json()["id"] == card["id"]
    assert [c["id"] for c in api.get("/api/v1/billing/cards/").json()["results"]] == [card["id"]]
    assert other_api.get("/api/v1/billing/cards/").json()["results"] == []
    stolen = other_api.post("/api/v1/billing/cards/", {"setup_intent": intent["setup_intent"]}, format="json")
    assert stolen.status_code == 400 and "not yours" in stolen.json()["setup_intent"][0]


@pytest.mark.django_db
def test_saving_a_card_refuses_declined_unknown_and_malformed_ones(localstripe, api):
    declined = api.post("/api/v1/billing/cards/", {"payment_method": "pm_card_visa_chargeDeclined"}, format="json")
    assert declined.status_code == 402 and "declined" in declined.json()["detail"]
    unknown = api.post("/api/v1/billing/cards/", {"payment_method": "pm_nonexistent123"}, format="json")
    assert unknown.status_code == 400 and "No such" in unknown.json()["payment_method"][0]
    for body in ({"payment_method": "card_123"}, {}, {"payment_method": "pm_1", "setup_intent": "seti_1"},
                 {"payment_method": 5}, {"card_number": "4242424242424242"}):
        assert api.post("/api/v1/billing/cards/", body, format="json").status_code == 400, body
    assert not Card.objects.exists()


@pytest.mark.django_db
def test_a_card_can_be_removed_by_its_owner_only(localstripe, api, other_api):
    card = save_card(api)
    assert other_api.delete(f"/api/v1/billing/cards/{card['id']}/").status_code == 404
    assert api.delete("/api/v1/billing/cards/x/").status_code == 404
    assert api.delete(f"/api/v1/billing/cards/{card['id']}/").status_code == 204
    assert not Card.objects.exists()


# -------------------------------------------------------------------------------------------- top-ups


@pytest.mark.django_db(transaction=True)
def test_a_top_up_is_credited_once_when_the_webhook_arrives(stripe_webhooks, client_for):
    api = client_for(UserFactory())
    card = save_card(api)
    response = api.post("/api/v1/billing/top-ups/", {"amount": "25.00", "card": card["id"]}, format="json")
    assert response.status_code == 202, response.content
    top_up = response.json()
    assert top_up["status"] in ("processing", "succeeded") and top_up["amount"] == "25.000000"
    assert wait_for(lambda: balance(api.user) == 25_000_000), "the webhook never credited the wallet"
    assert api.get(f"/api/v1/billing/top-ups/{top_up['id']}/").json()["status"] == "succeeded"
    event = StripeEvent.objects.get(type="payment_intent.succeeded", status="processed")
    assert event.payload["data"]["object"]["metadata"]["top_up_id"] == str(top_up["id"])
    # Stripe delivers it again (a retry, a replay): nothing more is credited.
    again = deliver(api, event.payload)
    assert again.status_code == 200 and again.json() == {"received": True, "status": "processed"}
    event.refresh_from_db()
    assert event.deliveries == 2 and balance(api.user) == 25_000_000
    assert LedgerTransaction.objects.filter(kind="top_up").count() == 1
    assert BillingEvent.objects.filter(user=api.user, kind="top_up_succeeded").count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_declined_card_credits_nothing_and_the_api_says_so(stripe_webhooks, client_for):
    api = client_for(UserFactory())
    card = save_card(api, "pm_card_chargeCustomerFail")  # attaches, then declines when charged
    response = api.post("/api/v1/billing/top-ups/", {"amount": "50.00", "card": card["id"]}, format="json")
    assert response.status_code == 402
    body = response.json()
    assert "declined" in body["detail"] and "Nothing was charged" in body["detail"]
    top_up = TopUp.objects.get(pk=body["top_up"])
    assert top_up.status == TopUpStatus.FAILED and "declined" in top_up.failure_message
    assert wait_for(lambda: StripeEvent.objects.filter(type="payment_intent.payment_failed",
                                                       status="processed").exists())
    assert balance(api.user) == 0 and not LedgerTransaction.objects.filter(kind="top_up").exists()


@pytest.mark.django_db
def test_top_up_amounts_out_of_range_or_malformed_are_refused(api, other_api):
    card = Card.objects.create(user=api.user, stripe_payment_method_id="pm_local_1", brand="visa", last4="4242")
    theirs = Card.objects.create(user=other_api.user, stripe_payment_method_id="pm_local_2")
    for body in ({"amount": "4.99", "card": card.pk}, {"amount": "10000.01", "card": card.pk},
                 {"amount": "25.001", "card": card.pk}, {"amount": 25, "card": card.pk},
                 {"amount": "abc", "card": card.pk}, {"amount": "-5.00", "card": card.pk},
                 {"amount": "NaN", "card": card.pk}, {"amount": "25.00"}, {"card": card.pk},
                 {"amount": "25.00", "card": theirs.pk}, {"amount": "25.00", "card": 999999},
                 {"amount": "25.00", "card": card.pk, "status": "succeeded"}, {"amount": "1e3", "card": card.pk}):
        response = api.post("/api/v1/billing/top-ups/", body, format="json")
        assert response.status_code == 400, (body, response.content)
    assert api.post("/api/v1/billing/top-ups/", "[]", content_type="application/json").status_code == 400
    assert api.post("/api/v1/billing/top-ups/", "amount=25", content_type="application/x-www-form-urlencoded") \
        .status_code == 415
    assert not TopUp.objects.exists()


@pytest.mark.django_db
def test_a_stripe_outage_is_a_clear_503_and_credits_nothing(api, settings):
    settings.STRIPE_API_BASE = "http://127.0.0.1:9"  # nothing listens there
    card = Card.objects.create(user=api.user, stripe_payment_method_id="pm_local_1")
    response = api.post("/api/v1/billing/top-ups/", {"amount": "20.00", "card": card.pk}, format="json")
    assert response.status_code == 503
    detail = response.json()["detail"]  # no answer while making the Stripe customer: no charge was asked for
    assert "did not answer" in detail and detail.endswith("Your card was not charged.")
    assert balance(api.user) == 0 and not LedgerTransaction.objects.exists()
    top_up = TopUp.objects.get()
    assert top_up.status == TopUpStatus.FAILED and top_up.payment_intent_id is None
    assert api.post("/api/v1/billing/cards/setup-intent/").status_code == 503


@pytest.mark.django_db
def test_an_idempotency_key_makes_a_retried_top_up_charge_once(localstripe, api):
    card = save_card(api)
    body = {"amount": "30.00", "card": card["id"]}
    first = api.post("/api/v1/billing/top-ups/", body, format="json", HTTP_IDEMPOTENCY_KEY="retry-1")
    second = api.post("/api/v1/billing/top-ups/", body, format="json", HTTP_IDEMPOTENCY_KEY="retry-1")
    assert (first.status_code, second.status_code) == (202, 200)
    assert first.json()["id"] == second.json()["id"] and TopUp.objects.count() == 1
    other = api.post("/api/v1/billing/top-ups/", {**body, "amount": "31.00"}, format="json",
                     HTTP_IDEMPOTENCY_KEY="retry-1")
    assert other.status_code == 422
    assert api.post("/api/v1/billing/top-ups/", body, format="json", HTTP_IDEMPOTENCY_KEY="bad key").status_code == 400


@pytest.mark.django_db
def test_top_ups_are_private(api, other_api):
    top_up = TopUp.objects.create(user=api.user, amount_micros=10_000_000)
    assert api.get(f"/api/v1/billing/top-ups/{top_up.pk}/").status_code == 200
    assert other_api.get(f"/api/v1/billing/top-ups/{top_up.pk}/").status_code == 404
    assert other_api.get("/api/v1/billing/top-ups/").json()["results"] == []
    assert api.get("/api/v1/billing/top-ups/abc/").status_code == 404
    for odd in ("%C2%B2", "%D9%A3"):  # "²" and "٣": digits to str.isdigit(), not to int() or the database
        assert api.get(f"/api/v1/billing/top-ups/{odd}/").status_code == 404
        assert api.delete(f"/api/v1/billing/cards/{odd}/").status_code == 404


# ------------------------------------------------------------------------------------------- webhooks


@pytest.mark.django_db
def test_a_webhook_with_a_missing_or_bad_signature_is_400_and_records_nothing(api):
    top_up = TopUp.objects.create(user=api.user, amount_micros=10_000_000, status=TopUpStatus.PROCESSING)
    event = intent_event("evt_forged", "payment_intent.succeeded", top_up)
    assert deliver(api, event, signature="").status_code == 400
    assert deliver(api, event, secret="whsec_wrong").status_code == 400
    assert deliver(api, event, signature="t=1,v1=00").status_code == 400
    body = json.dumps(event).encode()
    stale = sign(body, at=int(time.time()) - 3600)
    assert deliver(api, event, signature=stale).status_code == 400
    not_json = b"not json"
    assert api.post(WEBHOOK, data=not_json, content_type="application/json",
                    HTTP_STRIPE_SIGNATURE=sign(not_json)).status_code == 400
    assert not StripeEvent.objects.exists() and balance(api.user) == 0


@pytest.mark.django_db
def test_replayed_duplicated_and_out_of_order_events_never_credit_twice(api):
    top_up = TopUp.objects.create(user=api.user, amount_micros=10_000_000, status=TopUpStatus.PROCESSING,
                                  payment_intent_id="pi_a")
    failed_first = intent_event("evt_0", "payment_intent.payment_failed", top_up, id="pi_a",
                                last_payment_error={"message": "Your card was declined."})
    succeeded = intent_event("evt_1", "payment_intent.succeeded", top_up, id="pi_a")
    duplicate = intent_event("evt_2", "payment_intent.succeeded", top_up, id="pi_a")  # another id, same payment
    late_failure = intent_event("evt_3", "payment_intent.payment_failed", top_up, id="pi_a")
    for event in (failed_first, succeeded, succeeded, duplicate, late_failure, succeeded):
        assert deliver(api, event).status_code == 200
    top_up.refresh_from_db()
    assert top_up.status == TopUpStatus.SUCCEEDED and balance(api.user) == 10_000_000
    assert LedgerTransaction.objects.filter(kind="top_up").count() == 1
    assert StripeEvent.objects.get(event_id="evt_1").deliveries == 3
    assert StripeEvent.objects.count() == 4


@pytest.mark.django_db
def test_events_the_platform_does_not_act_on_are_stored_as_ignored(api):
    response = deliver(api, {"id": "evt_c", "type": "customer.created", "data": {"object": {"id": "cus_1"}}})
    assert response.status_code == 200 and response.json()["status"] == "ignored"
    stranger = {"id": "evt_p", "type": "payment_intent.succeeded",
                "data": {"object": {"id": "pi_unknown", "amount": 100, "currency": "usd", "metadata": {}}}}
    assert deliver(api, stranger).json()["status"] == "ignored"
    assert deliver(api, {"no": "id"}).status_code == 400


@pytest.mark.django_db
def test_an_event_that_does_not_match_its_top_up_fails_visibly_and_credits_nothing(api):
    top_up = TopUp.objects.create(user=api.user, amount_micros=10_000_000, status=TopUpStatus.PROCESSING)
    response = deliver(api, intent_event("evt_x", "payment_intent.succeeded", top_up, amount_cents=99_999))
    assert response.status_code == 500 and response.json()["status"] == "failed"
    event = StripeEvent.objects.get(event_id="evt_x")
    assert event.status == "failed" and "Stripe charged" in event.error
    assert balance(api.user) == 0


# -------------------------------------------------------------------------------------------- refunds


def _credited_top_up(localstripe, api, amount="40.00") -> TopUp:
    """A top-up charged at localstripe and credited by its (signed) payment_intent.succeeded event."""
    card = save_card(api)
    top_up = TopUp.objects.get(pk=api.post("/api/v1/billing/top-ups/", {"amount": amount, "card": card["id"]},
                                           format="json").json()["id"])
    intent = stripe_client(localstripe).payment_intents.retrieve(top_up.payment_intent_id)
    event = {"id": f"evt_{intent.id}", "type": "payment_intent.succeeded", "data": {"object": intent.to_dict()}}
    assert deliver(api, event).json()["status"] == "processed"
    top_up.refresh_from_db()
    return top_up


@pytest.mark.django_db
def test_an_operator_refunds_a_top_up_and_the_wallet_is_debited_once(localstripe, api, refund_operator_api):
    top_up = _credited_top_up(localstripe, api)
    assert balance(api.user) == 40_000_000
    body = {"top_up": top_up.pk, "amount": "15.00", "reason": "customer asked"}
    assert api.post("/api/v1/billing/refunds/", body, format="json").status_code == 403
    response = refund_operator_api.post("/api/v1/billing/refunds/", body, format="json")
    assert response.status_code == 201, response.content
    refund = response.json()
    assert refund["status"] == "succeeded" and refund["stripe_refund_id"].startswith("re_")
    assert refund["created_by"] == refund_operator_api.user.email
    assert balance(api.user) == 25_000_000
    payments.refund_confirm(refund_id=refund["id"], stripe_refund_id=refund["stripe_refund_id"])  # again: no-op
    assert balance(api.user) == 25_000_000
    txn = Refund.objects.get(pk=refund["id"]).transaction
    assert txn.created_by == refund_operator_api.user and txn.reason == "customer asked"
    too_much = refund_operator_api.post("/api/v1/billing/refunds/", {**body, "amount": "25.01"}, format="json")
    assert too_much.status_code == 409 and "$25.00" in too_much.json()["detail"]
    assert api.get(f"/api/v1/billing/top-ups/{top_up.pk}/").json()["refunded"] == "15.000000"
    assert BillingEvent.objects.filter(user=api.user, kind="refund").exists()


@pytest.mark.django_db
def test_a_refund_retried_with_its_idempotency_key_refunds_once(localstripe, api, refund_operator_api):
    """A retry after a lost answer refunded again (found by review). The same key and body answer with the first
    refund (200); another body is a 422; the key is the operator's own."""
    top_up = _credited_top_up(localstripe, api, "50.00")
    body = {"top_up": top_up.pk, "amount": "10.00", "reason": "goodwill"}
    first = refund_operator_api.post("/api/v1/billing/refunds/", body, format="json",
                                     HTTP_IDEMPOTENCY_KEY="refund-once-1")
    again = refund_operator_api.post("/api/v1/billing/refunds/", body, format="json",
                                     HTTP_IDEMPOTENCY_KEY="refund-once-1")
    assert first.status_code == 201 and again.status_code == 200, again.content
    assert again.json() == first.json()
    assert Refund.objects.filter(top_up=top_up).count() == 1 and balance(api.user) == 40_000_000
    other = refund_operator_api.post("/api/v1/billing/refunds/", {**body, "amount": "5.00"}, format="json",
                                     HTTP_IDEMPOTENCY_KEY="refund-once-1")
    assert other.status_code == 422 and str(first.json()["id"]) in other.json()["detail"]
    assert refund_operator_api.post("/api/v1/billing/refunds/", body, format="json",
                                    HTTP_IDEMPOTENCY_KEY="refund-once-2").status_code == 201  # a new key: new refund
    assert balance(api.user) == 30_000_000


@pytest.mark.django_db
def test_two_refunds_sent_at_once_with_one_idempotency_key_refund_once(localstripe, api, monkeypatch):
    """The database decides (refund_unique_idempotency_key), not a look before the insert: a request that looked
    before the other one's refund was there loses at the insert and answers with that refund."""
    from billing.services import refunds

    top_up = _credited_top_up(localstripe, api, "50.00")
    operator = UserFactory(is_staff=True)
    first, created = refunds.refund_create_once(top_up=top_up, amount_micros=10_000_000, reason="goodwill",
                                                created_by=operator, idempotency_key="k", request_fingerprint="f")
    looks = []
    look = refunds.refund_for_idempotency_key

    def too_early_then_found(**kwargs):
        looks.append(kwargs)
        return None if len(looks) == 1 else look(**kwargs)

    monkeypatch.setattr(refunds, "refund_for_idempotency_key", too_early_then_found)
    again, created_again = refunds.refund_create_once(
        top_up=top_up, amount_micros=10_000_000, reason="goodwill", created_by=operator, idempotency_key="k",
        request_fingerprint="f")
    assert created and not created_again and again.pk == first.pk and len(looks) == 2
    assert Refund.objects.filter(top_up=top_up).count() == 1 and balance(api.user) == 40_000_000


@pytest.mark.django_db
def test_a_retry_of_a_whole_refund_that_looked_too_early_gets_the_refund_not_a_409(localstripe, api, monkeypatch):
    """The same race where the first refund used the whole refundable amount: the retry was refused by the amount
    check ("At most $0.00 ... can still be refunded", a 409) before it reached the key's index; it answers with the
    first refund."""
    from billing.services import refunds

    top_up = _credited_top_up(localstripe, api, "50.00")
    operator = UserFactory(is_staff=True)
    first, _ = refunds.refund_create_once(top_up=top_up, amount_micros=50_000_000, reason="all", created_by=operator,
                                          idempotency_key="whole", request_fingerprint="f")
    looks = []
    look = refunds.refund_for_idempotency_key

    def too_early_then_found(**kwargs):
        looks.append(kwargs)
        return None if len(looks) == 1 else look(**kwargs)

    monkeypatch.setattr(refunds, "refund_for_idempotency_key", too_early_then_found)
    again, created = refunds.refund_create_once(top_up=top_up, amount_micros=50_000_000, reason="all",
                                                created_by=operator, idempotency_key="whole", request_fingerprint="f")
    assert not created and again.pk == first.pk and len(looks) == 2
    looks.clear()
    with pytest.raises(Conflict, match=r"At most \$0\.00"):  # another key: the amount check's own answer
        refunds.refund_create_once(top_up=top_up, amount_micros=50_000_000, reason="all", created_by=operator,
                                   idempotency_key="other", request_fingerprint="f")
    assert Refund.objects.filter(top_up=top_up).count() == 1 and balance(api.user) == 0


@pytest.mark.django_db
def test_a_refund_stripe_says_failed_before_its_answer_is_recorded_debits_nothing(localstripe, api):
    """refund.failed can reach the webhook between Stripe's answer to the create and its recording: the refund,
    still pending, failed; refund_confirm then took it for one made after all and debited the wallet."""
    from billing.services.refunds import stripe_refund_apply

    top_up = _credited_top_up(localstripe, api)
    refund = Refund.objects.create(top_up=top_up, amount_micros=15_000_000, reason="customer asked",
                                   created_by=UserFactory(is_staff=True))
    with transaction.atomic():
        assert stripe_refund_apply(stripe_refund={"id": "re_raced", "status": "failed",
                                                  "failure_reason": "expired_or_canceled_card",
                                                  "metadata": {"refund_id": str(refund.pk)}})
    payments.refund_confirm(refund_id=refund.pk, stripe_refund_id="re_raced")  # the create's answer, recorded
    refund.refresh_from_db()
    assert refund.status == "failed" and refund.transaction is None and "expired or canceled card" in \
        refund.failure_message
    assert balance(api.user) == 40_000_000


@pytest.mark.django_db
def test_an_operator_is_told_a_refund_stripe_failed_while_its_answer_travelled(localstripe, api, monkeypatch):
    """The same race through refund_create: it returned the failed refund as if made, and the admin action said
    'done' (found by review). Stripe's answer is held back while its refund.failed webhook is applied."""
    from types import SimpleNamespace

    from billing.services import refunds

    top_up = _credited_top_up(localstripe, api)

    def create(params, options):
        with transaction.atomic():  # Stripe's refund.failed webhook, applied while the answer travels
            refunds.stripe_refund_apply(stripe_refund={"id": "re_raced", "status": "failed",
                                                       "metadata": {"refund_id": params["metadata"]["refund_id"]}})
        return SimpleNamespace(id="re_raced", status="pending")

    monkeypatch.setattr(refunds, "client", lambda: SimpleNamespace(v1=SimpleNamespace(
        refunds=SimpleNamespace(create=create))))
    with pytest.raises(Conflict, match="the amount held for it is back in the balance. The refund failed; the "
                                       "customer's balance is as it was"):
        payments.refund_create(top_up=top_up, amount_micros=15_000_000, reason="asked",
                               created_by=UserFactory(is_staff=True))
    assert Refund.objects.get().status == "failed" and balance(api.user) == 40_000_000


@pytest.mark.django_db
def test_a_refund_cannot_give_back_money_already_spent(localstripe, api, refund_operator_api):
    top_up = _credited_top_up(localstripe, api, "10.00")
    instance = running(api.user, node("3.600000"))
    usage_close(instance=instance, until=instance.started_at + timedelta(seconds=3000))  # $3 spent
    response = refund_operator_api.post("/api/v1/billing/refunds/", {"top_up": top_up.pk, "amount": "10.00",
                                                              "reason": "full refund"}, format="json")
    assert response.status_code == 409 and "spent" in response.json()["detail"]
    assert refund_operator_api.post("/api/v1/billing/refunds/", {"top_up": top_up.pk, "amount": "7.00",
                                                          "reason": "what is left"}, format="json").status_code == 201
    assert balance(api.user) == 0
    for bad in ({"top_up": top_up.pk, "amount": "1.00", "reason": ""}, {"top_up": 10**9, "amount": "1.00",
                                                                        "reason": "x"},
                {"top_up": top_up.pk, "amount": "0.001", "reason": "x"}):
        assert refund_operator_api.post("/api/v1/billing/refunds/", bad, format="json").status_code == 400, bad


@pytest.mark.django_db
def test_a_customer_stripe_lost_is_made_again_and_its_cards_forgotten(localstripe, api):
    first = save_card(api)
    old_customer = api.user.billing_profile.stripe_customer_id
    localstripe.wipe()  # a fresh localstripe (the demo starts one from scratch each time)
    second = save_card(api)
    api.user.billing_profile.refresh_from_db()
    assert api.user.billing_profile.stripe_customer_id != old_customer
    assert [c["id"] for c in api.get("/api/v1/billing/cards/").json()["results"]] == [second["id"]]
    assert not Card.objects.filter(pk=first["id"]).exists()
