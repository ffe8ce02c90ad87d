"""The Stripe webhook refuses, with a 400 and without storing anything, whatever is not a genuine, fresh event:
a signature made more than 300 s before or after now (Stripe's tolerance, both sides), a body that is not a
JSON object event (a list, a string, a number), a body PostgreSQL could not store (NUL). Deliveries are signed
as localstripe signs them (localstripe/webhooks.py: the event's JSON, `t=<created>,v1=<HMAC-SHA256>`)."""
import hashlib
import hmac
import json
import time

import pytest

from billing.models import StripeEvent, TopUp, TopUpStatus
from billing.services.webhooks import SIGNATURE_TOLERANCE_S, webhook_receive
from tests.billing.conftest import WEBHOOK_SECRET
from tests.billing.helpers import balance

pytestmark = pytest.mark.django_db

WEBHOOK = "/api/v1/billing/stripe/webhook/"


def localstripe_signed(payload: bytes, at: int, secret: str = WEBHOOK_SECRET) -> str:
    """The Stripe-Signature header localstripe sends with a delivery made at `at`."""
    signature = hmac.new(secret.encode(), b"%d.%s" % (at, payload), hashlib.sha256).hexdigest()
    return f"t={at},v1={signature}"


def event_body(event) -> bytes:
    return json.dumps(event, indent=2, sort_keys=True).encode()  # as localstripe serializes its events


def post(client, payload: bytes, signature: str | None):
    headers = {} if signature is None else {"HTTP_STRIPE_SIGNATURE": signature}
    return client.post(WEBHOOK, data=payload, content_type="application/json; charset=utf-8", **headers)


def deliver(client, event, at: int | None = None):
    payload = event if isinstance(event, bytes) else event_body(event)
    return post(client, payload, localstripe_signed(payload, int(time.time()) if at is None else at))


def succeeded(top_up: TopUp, event_id: str = "evt_h1") -> dict:
    return {"id": event_id, "object": "event", "type": "payment_intent.succeeded", "created": int(time.time()),
            "data": {"object": {"id": f"pi_{top_up.pk}", "object": "payment_intent", "currency": "usd",
                                "amount": top_up.amount_micros // 10_000, "metadata": {"top_up_id": str(top_up.pk)}}}}


@pytest.fixture
def top_up(user):
    return TopUp.objects.create(user=user, amount_micros=10_000_000, status=TopUpStatus.PROCESSING)


# --- the timestamp: bounded on both sides ------------------------------------------------------------------------


@pytest.mark.parametrize("offset", [3600, SIGNATURE_TOLERANCE_S + 5, -(SIGNATURE_TOLERANCE_S + 5), -3600])
def test_a_signature_made_too_far_from_now_is_refused_and_credits_nothing(anon, top_up, offset):
    """A correctly signed delivery an hour in the future was accepted: a captured one could be replayed for an
    hour. Both sides are bounded by Stripe's tolerance."""
    response = deliver(anon, succeeded(top_up), at=int(time.time()) + offset)
    assert response.status_code == 400
    assert response.json() == {"detail": f"The signature's timestamp is more than {SIGNATURE_TOLERANCE_S} s from now."}
    assert not StripeEvent.objects.exists() and balance(top_up.user) == 0


@pytest.mark.parametrize("offset", [0, 1, SIGNATURE_TOLERANCE_S - 5, -(SIGNATURE_TOLERANCE_S - 5)])
def test_a_signature_within_the_tolerance_is_accepted(anon, top_up, offset):
    response = deliver(anon, succeeded(top_up), at=int(time.time()) + offset)
    assert response.status_code == 200 and response.json() == {"received": True, "status": "processed"}
    assert balance(top_up.user) == 10_000_000


def test_the_bounds_hold_for_the_service_too(top_up):
    payload = event_body(succeeded(top_up))
    with pytest.raises(Exception, match="from now"):
        webhook_receive(payload=payload, signature=localstripe_signed(payload, int(time.time()) + 3600))
    assert webhook_receive(payload=payload, signature=localstripe_signed(payload, int(time.time()))).status == \
        "processed"


def test_one_valid_signature_among_several_is_enough_as_when_stripe_rolls_the_secret(anon, top_up):
    payload = event_body(succeeded(top_up))
    at = int(time.time())
    good = localstripe_signed(payload, at)
    old = localstripe_signed(payload, at, secret="whsec_the_old_one")
    header = f"{old},{good.split(',')[1]}"
    assert post(anon, payload, header).status_code == 200


@pytest.mark.parametrize("header", [
    "", "t=", "v1=00", "t=abc,v1=00", "t=1,v1=", "garbage", "t=99999999999999999999,v1=00",
])
def test_malformed_signature_headers_are_400(anon, top_up, header):
    assert post(anon, event_body(succeeded(top_up)), header).status_code == 400
    assert post(anon, event_body(succeeded(top_up)), None).status_code == 400
    assert not StripeEvent.objects.exists()


# --- the body: a JSON object event, nothing else -----------------------------------------------------------------


@pytest.mark.parametrize("body", [
    b"[]", b'[{"id": "evt_1", "type": "payment_intent.succeeded"}]', b'"a string"', b'"evt_1"', b"42", b"1.5",
    b"true", b"null", b"{}", b'{"id": "evt_1"}', b'{"type": "x"}', b'{"id": 1, "type": "x", "data": {"object": {}}}',
    b'{"id": "", "type": "x", "data": {"object": {}}}', b'{"id": "evt_1", "type": "x"}',
    b'{"id": "evt_1", "type": "x", "data": []}', b'{"id": "evt_1", "type": "x", "data": {"object": "pi_1"}}',
    b'{"id": "evt_1", "type": "payment_intent.succeeded", "data": {"object": []}}',
])
def test_a_validly_signed_body_that_is_not_an_event_object_is_400(anon, body):
    """A JSON list or string was a 500 (AttributeError inside Stripe's library); a number, null, or an object
    without `id`, `type` and `data.object` is no event either."""
    response = deliver(anon, body)
    assert response.status_code == 400, response.content
    assert response.json()["detail"].startswith("Not a Stripe event")
    assert not StripeEvent.objects.exists()


@pytest.mark.parametrize("body", [
    b'{"id": "evt_\\u0000", "type": "x", "data": {"object": {}}}',
    b'{"id": "evt_1", "type": "x\\u0000", "data": {"object": {}}}',
    b'{"id": "evt_1", "type": "x", "data": {"object": {"metadata": {"top_up_id": "\\u0000"}}}}',
    b'{"id": "evt_1", "type": "x", "data": {"object": {"k\\u0000": 1}}, "extra": ["\\u0000"]}',
])
def test_a_body_with_a_nul_anywhere_is_400_not_a_database_error(anon, body):
    response = deliver(anon, body)
    assert response.status_code == 400, response.content
    assert response.json() == {"detail": "Not a Stripe event: the body contains a NUL character."}
    assert not StripeEvent.objects.exists()


@pytest.mark.parametrize("body", [b"not json", b"{", b"\xff\xfe{}", b""])
def test_a_body_that_is_not_json_is_400(anon, body):
    signature = localstripe_signed(body, int(time.time()))
    response = post(anon, body, signature)
    assert response.status_code == 400 and response.json() == {"detail": "The body is not JSON."}
    assert not StripeEvent.objects.exists()


def test_a_genuine_event_still_credits_once(anon, top_up):
    event = succeeded(top_up, "evt_genuine")
    assert deliver(anon, event).json() == {"received": True, "status": "processed"}
    assert deliver(anon, event).json() == {"received": True, "status": "processed"}
    assert StripeEvent.objects.get(event_id="evt_genuine").deliveries == 2
    assert balance(top_up.user) == 10_000_000


def test_a_payment_intents_client_secret_is_not_stored(anon, top_up):
    """The stored event was shown whole on the operators' page, with the secret that confirms the payment from a
    browser (found by review). The event still credits the top-up."""
    event = succeeded(top_up, "evt_secret")
    event["data"]["object"]["client_secret"] = "pi_1_secret_ZZZtopsecretZZZ"
    event["data"]["object"]["next_action"] = {"use_stripe_sdk": {"ephemeral_key_secret": "ek_ZZZalsosecretZZZ"}}
    assert deliver(anon, event).json() == {"received": True, "status": "processed"}
    stored = StripeEvent.objects.get(event_id="evt_secret").payload
    assert "ZZZ" not in json.dumps(stored)
    assert stored["data"]["object"]["client_secret"] == "[redacted]"
    assert stored["data"]["object"]["metadata"] == {"top_up_id": str(top_up.pk)}
    assert balance(top_up.user) == 10_000_000


# --- what an event's object must carry to be matched ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["payment_intent.succeeded", "payment_intent.payment_failed"])
@pytest.mark.parametrize("intent_id", ["missing", None, "", 7])
def test_a_signed_intent_without_an_id_is_ignored_with_the_reason_not_matched_to_anyones_top_up(
        anon, intent_id, kind):
    """Matching by `payment_intent_id = <the intent's id>` became `IS NULL` for an intent without one: the newest
    top-up of any user not yet given a PaymentIntent was taken for it, and credited (`"id": null`) or failed
    (found by review)."""
    from tests.factories import UserFactory

    someone = UserFactory()
    theirs = TopUp.objects.create(user=someone, amount_micros=10_000_000, status=TopUpStatus.PENDING)
    event = {"id": "evt_no_id", "object": "event", "type": kind, "created": int(time.time()),
             "data": {"object": {"object": "payment_intent", "currency": "usd", "amount": 1000, "metadata": {}}}}
    if intent_id != "missing":
        event["data"]["object"]["id"] = intent_id
    assert deliver(anon, event).json() == {"received": True, "status": "ignored"}
    stored = StripeEvent.objects.get(event_id="evt_no_id")
    assert "has no id" in stored.error
    theirs.refresh_from_db()
    assert theirs.status == TopUpStatus.PENDING and balance(someone) == 0


def test_a_failed_refund_event_without_an_id_is_ignored_with_the_reason(anon):
    event = {"id": "evt_rf_no_id", "object": "event", "type": "refund.failed", "created": int(time.time()),
             "data": {"object": {"object": "refund", "status": "failed", "metadata": {"refund_id": "1"}}}}
    assert deliver(anon, event).json() == {"received": True, "status": "ignored"}
    assert "has no usable id" in StripeEvent.objects.get(event_id="evt_rf_no_id").error


def test_an_intent_naming_a_top_up_another_payment_pays_is_not_credited_to_it(anon, top_up):
    TopUp.objects.filter(pk=top_up.pk).update(payment_intent_id="pi_the_real_one")
    event = succeeded(top_up, "evt_other_pi")  # pi_<id>, naming the top-up in its metadata
    assert deliver(anon, event).status_code == 500
    stored = StripeEvent.objects.get(event_id="evt_other_pi")
    assert stored.status == "failed" and "pi_the_real_one" in stored.error
    assert balance(top_up.user) == 0


def test_a_top_up_charged_on_a_customer_stripe_later_lost_is_still_credited_when_it_succeeds(localstripe, api):
    """Saving a card replaces a Stripe customer that Stripe says is gone (customers.customer_for(verify=True)); a
    top-up charged on the old one that succeeds afterwards failed the customer check for good: the card was charged
    and nothing credited. The top-up row says whose it is: its recorded PaymentIntent (or the intent's metadata
    naming its user) is enough; an intent of another customer naming it is still refused."""
    from tests.billing.test_payments import deliver as deliver_signed
    from tests.billing.test_payments import save_card, stripe_client

    card = save_card(api)
    answer = api.post("/api/v1/billing/top-ups/", {"amount": "40.00", "card": card["id"]}, format="json")
    top_up = TopUp.objects.get(pk=answer.json()["id"])
    assert top_up.status == TopUpStatus.PROCESSING
    intent = stripe_client(localstripe).payment_intents.retrieve(top_up.payment_intent_id).to_dict()
    old_customer = api.user.billing_profile.stripe_customer_id
    assert intent["customer"] == old_customer
    localstripe.wipe()  # Stripe no longer knows the customer: the next card saved makes a new one
    save_card(api)
    api.user.billing_profile.refresh_from_db()
    assert api.user.billing_profile.stripe_customer_id != old_customer
    # Another customer's intent naming this top-up, neither its recorded intent nor of its user: refused.
    stranger = {**intent, "id": "pi_stranger", "customer": "cus_stranger", "metadata": {"top_up_id": str(top_up.pk)}}
    TopUp.objects.filter(pk=top_up.pk).update(payment_intent_id=None)
    assert deliver_signed(api, {"id": "evt_stranger", "type": "payment_intent.succeeded",
                                "data": {"object": stranger}}).status_code == 500
    TopUp.objects.filter(pk=top_up.pk).update(payment_intent_id=intent["id"])
    event = {"id": "evt_old_customer", "type": "payment_intent.succeeded", "data": {"object": intent}}
    assert deliver_signed(api, event).json() == {"received": True, "status": "processed"}
    top_up.refresh_from_db()
    assert top_up.status == TopUpStatus.SUCCEEDED and balance(api.user) == 40_000_000
