"""A signed Stripe event whose object holds a field of the wrong type is ignored with the reason (200), never credited
from, and never a 500 on every delivery (review r51, findings 1 and 2).

Every amount read from a Stripe object is read as whole cents (charges.whole_cents): `payment_intent.succeeded`
read `int(intent["amount"])`, so a string "1000" was credited, a float 1000.9 truncated to $10.00 and credited, and a
missing amount, a string `last_payment_error` or a dispute's or refund's odd field raised KeyError, TypeError or
AttributeError: the event failed (500), and Stripe's next delivery carried the same object, for days. The follow-up
that asks Stripe when the webhook never came (billing.services.reconcile) applies the same rule: the top-up is left
as it is, and why is logged."""
import logging
import time

import pytest
import stripe as stripe_sdk
from django.utils import timezone

from billing.models import BillingEvent, BillingProfile, StripeEvent, TopUp, TopUpStatus
from billing.services import reconcile
from billing.services.reconcile import top_up_find_lost, top_up_reconcile
from tests.billing.helpers import balance
from tests.billing.test_disputes import USD_100, credited_top_up, dispute_event, refund_obj, refunded_event
from tests.billing.test_webhook_hardening import deliver

pytestmark = pytest.mark.django_db


@pytest.fixture
def top_up(user):
    return TopUp.objects.create(user=user, amount_micros=10_000_000, status=TopUpStatus.PROCESSING)


def event(top_up, kind="payment_intent.succeeded", event_id="evt_r1", **fields):
    obj = {"id": f"pi_{top_up.pk}", "object": "payment_intent", "currency": "usd", "amount": 1000,
           "metadata": {"top_up_id": str(top_up.pk)}}
    obj.update(fields)
    obj = {k: v for k, v in obj.items() if v is not ...}
    return {"id": event_id, "object": "event", "type": kind, "created": int(time.time()), "data": {"object": obj}}


def error_of(event_id="evt_r1") -> str:
    return StripeEvent.objects.get(event_id=event_id).error


# --- finding 1: an amount that is not whole cents credits nothing ---------------------------------------------------


@pytest.mark.parametrize("amount", ["1000", 1000.9, 1000.0, True, -1000])
def test_succeeded_with_an_amount_that_is_not_whole_cents_credits_nothing(anon, top_up, amount):
    response = deliver(anon, event(top_up, amount=amount))
    assert balance(top_up.user) == 0, (response.status_code, response.json())
    assert response.status_code == 200 and response.json()["status"] == "ignored"
    assert "`amount` is not a whole number of cents" in error_of()
    top_up.refresh_from_db()
    assert top_up.status == TopUpStatus.PROCESSING and top_up.transaction_id is None


def test_succeeded_with_another_whole_amount_than_the_top_up_asked_credits_nothing(anon, top_up):
    """Checked before (top_up_credit): a mismatch is failed for operators, not ignored."""
    response = deliver(anon, event(top_up, amount=1001))
    assert response.status_code == 500 and balance(top_up.user) == 0
    assert "Stripe charged 10010000" in error_of()


def test_succeeded_in_another_currency_credits_nothing(anon, top_up):
    assert deliver(anon, event(top_up, currency="eur")).status_code == 500
    assert balance(top_up.user) == 0 and "not usd" in error_of()


def test_the_whole_cents_amount_still_credits(anon, top_up):
    response = deliver(anon, event(top_up))
    assert response.status_code == 200 and response.json()["status"] == "processed"
    assert balance(top_up.user) == 10_000_000


# --- finding 2: odd payloads are ignored with the reason, not a 500 forever -----------------------------------------


@pytest.mark.parametrize("fields", [{"amount": ...}, {"amount": None}, {"amount": [1000]}])
def test_succeeded_missing_or_odd_amount_is_not_a_500_forever(anon, top_up, fields):
    for _ in range(2):
        response = deliver(anon, event(top_up, **fields))
    assert response.status_code == 200, (response.status_code, response.json(), error_of())
    assert "`amount` is not a whole number of cents" in error_of() and balance(top_up.user) == 0


@pytest.mark.parametrize("error", ["card_declined", ["x"], 7, {"message": 7}, {"message": ""}, None])
def test_payment_failed_with_an_odd_last_payment_error_is_not_a_500(anon, top_up, error):
    response = deliver(anon, event(top_up, kind="payment_intent.payment_failed", last_payment_error=error))
    assert response.status_code == 200, (response.status_code, response.json(), error_of())
    top_up.refresh_from_db()
    assert top_up.status == TopUpStatus.FAILED and top_up.failure_message == "The payment failed."


def test_payment_failed_still_says_the_banks_message(anon, top_up):
    response = deliver(anon, event(top_up, kind="payment_intent.payment_failed",
                                   last_payment_error={"message": "Your card was declined."}))
    assert response.status_code == 200
    top_up.refresh_from_db()
    assert top_up.status == TopUpStatus.FAILED and top_up.failure_message == "Your card was declined."


def test_an_expanded_customer_is_read_by_its_id(anon, top_up):
    """An expanded customer never equalled the id it was compared with: the event failed for good."""
    BillingProfile.objects.update_or_create(user=top_up.user, defaults={"stripe_customer_id": "cus_mine"})
    response = deliver(anon, event(top_up, customer={"id": "cus_mine", "object": "customer"}))
    assert response.status_code == 200 and balance(top_up.user) == 10_000_000


def test_an_intent_id_past_the_column_is_ignored_not_a_500(anon, top_up):
    response = deliver(anon, event(top_up, id="pi_" + "x" * 100))
    assert response.status_code == 200 and "longer than 100 characters" in error_of() and balance(top_up.user) == 0


# Every handler × a field it reads × a value of the wrong type: 200 (processed or ignored), never a 500; the ledger's
# invariants hold after each (tests/billing/conftest.py).
ODD = [None, ["x"], {"x": 1}, 7, 1.5, True, "x" * 101]

INTENT_FIELDS = ["id", "metadata", "customer", "currency", "amount", "latest_charge", "charges", "last_payment_error",
                 "status"]
DISPUTE_FIELDS = ["id", "amount", "currency", "charge", "payment_intent", "status", "reason"]
REFUND_FIELDS = ["id", "amount", "currency", "charge", "payment_intent", "status", "metadata", "reason",
                 "failure_reason"]
# (`refunds` of another shape is a charge that does not list them: Stripe is asked for them, as for newer API versions.)
CHARGE_FIELDS = ["id", "payment_intent", "currency"]


def _cases():
    for kind in ("payment_intent.succeeded", "payment_intent.payment_failed"):
        for name in [*INTENT_FIELDS, "metadata.top_up_id", "metadata.user_id"]:
            yield kind, name
    for kind in ("charge.dispute.created", "charge.dispute.closed", "charge.dispute.funds_reinstated"):
        for name in DISPUTE_FIELDS:
            yield kind, name
    for kind in ("refund.created", "refund.failed", "charge.refund.updated"):
        for name in REFUND_FIELDS:
            yield kind, name
    for name in CHARGE_FIELDS:
        yield "charge.refunded", name


def _odd_event(user, kind: str, name: str, value: object) -> dict:
    if kind.startswith("payment_intent."):
        top_up = TopUp.objects.create(user=user, amount_micros=10_000_000, status=TopUpStatus.PROCESSING)
        body = event(top_up, kind=kind, event_id="evt_odd", customer="cus_x")
        obj = body["data"]["object"]
    else:
        credited_top_up(user)
        if kind.startswith("charge.dispute."):
            body = dispute_event("evt_odd", kind=kind, status="won" if kind.endswith("closed") else "needs_response")
        elif kind == "charge.refunded":
            body = refunded_event("evt_odd", [refund_obj()])
        else:
            body = {"id": "evt_odd", "object": "event", "type": kind, "created": int(time.time()),
                    "data": {"object": refund_obj(status="failed" if kind == "refund.failed" else "succeeded")}}
        obj = body["data"]["object"]
    if "." in name:
        outer, inner = name.split(".")
        obj[outer][inner] = value
    else:
        obj[name] = value
    return body


ID_FIELDS = ("id", "customer", "charge", "payment_intent", "latest_charge")  # a string past the id column's length


def _odd_cases():
    for kind, name in _cases():
        for value in ODD:
            if isinstance(value, str) and name not in ID_FIELDS:
                continue
            # Read as they are: a whole amount (another than the top-up's fails for operators: tested above), no
            # PaymentIntent (the charge alone names the top-up: Stripe is asked which PaymentIntent made it).
            if (name, type(value)) in (("amount", int), ("payment_intent", type(None))):
                continue
            yield pytest.param(kind, name, value, id=f"{kind}-{name}-{type(value).__name__}")


@pytest.mark.parametrize(("kind", "name", "value"), list(_odd_cases()))
def test_a_field_of_the_wrong_type_is_never_a_500_nor_credited(anon, user, kind, name, value):
    response = deliver(anon, _odd_event(user, kind, name, value))
    assert response.status_code == 200, (response.status_code, response.json(), error_of("evt_odd"))
    if kind == "payment_intent.succeeded" and name in ("amount", "currency", "id"):
        assert balance(user) == 0
    assert balance(user) <= USD_100 if not kind.startswith("payment_intent.") else balance(user) in (0, 10_000_000)


# --- the follow-up that asks Stripe applies the same rule ------------------------------------------------------------


def _stripe_answers(monkeypatch, **intent) -> None:
    """Stripe's answer to the follow-up's lookup: a PaymentIntent as stripe-python builds it from Stripe's JSON."""
    answer = stripe_sdk.PaymentIntent.construct_from(intent, "sk_test_x")
    monkeypatch.setattr(reconcile, "client", lambda: type("C", (), {"v1": type("V", (), {
        "payment_intents": type("P", (), {"retrieve": staticmethod(lambda intent_id: answer)})})}))


@pytest.mark.parametrize("amount", ["1000", 1000.9, None, [1000]])
def test_the_follow_up_leaves_a_top_up_whose_payment_amount_is_not_whole_cents_as_it_is(
        user, monkeypatch, caplog, amount):
    top_up = TopUp.objects.create(user=user, amount_micros=10_000_000, status=TopUpStatus.PROCESSING,
                                  payment_intent_id="pi_odd")
    _stripe_answers(monkeypatch, id="pi_odd", object="payment_intent", status="succeeded", currency="usd",
                    amount=amount, metadata={"top_up_id": str(top_up.pk)})
    with caplog.at_level(logging.ERROR, logger="billing.services.reconcile"):
        assert top_up_reconcile(top_up_id=top_up.pk, now=timezone.now()) == "error"
    top_up.refresh_from_db()
    assert top_up.status == TopUpStatus.PROCESSING and balance(user) == 0
    assert "not a whole number of cents" in caplog.text and "left as it is" in caplog.text


def test_the_lost_charge_follow_up_leaves_an_odd_amount_uncredited(user, monkeypatch, caplog):
    top_up = TopUp.objects.create(user=user, amount_micros=10_000_000, status=TopUpStatus.FAILED,
                                  outcome_unknown=True, payment_intent_id="pi_odd")
    _stripe_answers(monkeypatch, id="pi_odd", object="payment_intent", status="succeeded", currency="usd",
                    amount="1000", metadata={"top_up_id": str(top_up.pk)})
    with caplog.at_level(logging.ERROR, logger="billing.services.reconcile"):
        assert top_up_find_lost(top_up_id=top_up.pk, now=timezone.now()) == "error"
    top_up.refresh_from_db()
    assert top_up.status == TopUpStatus.FAILED and top_up.outcome_unknown and balance(user) == 0
    assert "not a whole number of cents" in caplog.text


def test_the_lost_charge_follow_up_reads_a_string_last_payment_error(user, monkeypatch):
    """It raised AttributeError out of the run, every minute, before the top-ups behind it."""
    top_up = TopUp.objects.create(user=user, amount_micros=10_000_000, status=TopUpStatus.FAILED,
                                  outcome_unknown=True, payment_intent_id="pi_odd")
    _stripe_answers(monkeypatch, id="pi_odd", object="payment_intent", status="canceled", currency="usd",
                    amount=1000, metadata={"top_up_id": str(top_up.pk)}, last_payment_error="card_declined")
    assert top_up_find_lost(top_up_id=top_up.pk, now=timezone.now()) == "failed"
    top_up.refresh_from_db()
    assert top_up.status == TopUpStatus.FAILED and not top_up.outcome_unknown
    assert top_up.failure_message.startswith("The payment was canceled.")
    assert not BillingEvent.objects.filter(kind="top_up_succeeded").exists()


@pytest.mark.parametrize("top_up_id", ["9" * 25, "-1", "1e3", "١"])
def test_a_metadata_top_up_id_that_names_no_top_up_is_ignored(anon, top_up, top_up_id):
    response = deliver(anon, event(top_up, metadata={"top_up_id": top_up_id}))
    assert response.status_code == 200 and response.json()["status"] == "ignored" and balance(top_up.user) == 0


@pytest.mark.parametrize("status", [["warning_needs_response"], {"status": "won"}, 7])
def test_a_dispute_whose_status_is_not_text_is_ignored_with_the_reason(anon, user, status):
    """Read as text before, a list holding an inquiry's status was taken for a dispute that took the money."""
    credited_top_up(user)
    response = deliver(anon, dispute_event("evt_odd", status=status))
    assert response.status_code == 200 and response.json()["status"] == "ignored"
    assert "`status` is not a status" in error_of("evt_odd") and balance(user) == USD_100


def test_a_refund_failure_reason_that_is_not_text_still_gives_the_refund_back(anon, user):
    """`failure_reason` of another type raised AttributeError: a 500 on every delivery, the debit never given back."""
    credited_top_up(user)
    refund = {"id": "evt_r", "object": "event", "type": "refund.created", "created": int(time.time()),
              "data": {"object": refund_obj()}}
    assert deliver(anon, refund).status_code == 200 and balance(user) == USD_100 - 25_000_000
    failed = {"id": "evt_f", "object": "event", "type": "refund.failed", "created": int(time.time()),
              "data": {"object": refund_obj(status="failed", failure_reason={"code": "expired_or_canceled_card"})}}
    response = deliver(anon, failed)
    assert response.status_code == 200 and response.json()["status"] == "processed", error_of("evt_f")
    assert balance(user) == USD_100
