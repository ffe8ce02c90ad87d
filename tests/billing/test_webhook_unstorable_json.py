"""A correctly signed webhook body that parses as JSON but that PostgreSQL's jsonb cannot store (NaN, Infinity, a
number past the float range, a lone UTF-16 surrogate), or nested past what is read safely, is a 400 "Not a Stripe
event" with nothing recorded, as a body with a NUL is (test_webhook_hardening.py). Before (found by review), it
passed the event checks and the insert raised DataError ("invalid input syntax for type json"): a 500, and Stripe
delivered it again and again."""
import time

import pytest
from django.test import Client

from billing.models import StripeEvent
from tests.billing.test_webhook_hardening import localstripe_signed, post

pytestmark = pytest.mark.django_db


def _event(value: bytes) -> bytes:
    return b'{"id": "evt_x", "type": "customer.updated", "data": {"object": {"id": "cus_1", "x": ' + value + b"}}}"


@pytest.mark.parametrize(("body", "says"), [
    (_event(b"NaN"), "NaN"),
    (_event(b"Infinity"), "Infinity"),
    (_event(b"-Infinity"), "Infinity"),
    (_event(b"1e999"), "too large"),
    (_event(b"-1e999"), "too large"),
    (_event(b'[1, {"y": [NaN]}]'), "NaN"),
    (_event(b'"\\ud800"'), "surrogate"),
    (_event(b'"a\\udfffb"'), "surrogate"),
    (b'{"id": "evt_x", "type": "customer.updated", "data": {"object": {"id": "cus_1", "\\ud800": 1}}}', "surrogate"),
    (b'{"id": "evt_\\ud800", "type": "customer.updated", "data": {"object": {"id": "cus_1"}}}', "surrogate"),
    (_event(b"[" * 100 + b"]" * 100), "nested deeper"),
    (_event(b"[" * 5000 + b"]" * 5000), "nested deeper"),
], ids=["nan", "infinity", "-infinity", "1e999", "-1e999", "nan-deep-inside", "lone-high-surrogate",
        "lone-low-surrogate", "surrogate-key", "surrogate-id", "deep", "deeper-than-recursion"])
def test_unstorable_signed_body_is_400(body, says):
    response = post(Client(raise_request_exception=False), body, localstripe_signed(body, int(time.time())))
    assert response.status_code == 400, response.content
    detail = response.json()["detail"]
    assert detail.startswith("Not a Stripe event") and says in detail
    assert not StripeEvent.objects.exists()


@pytest.mark.parametrize("value", [b"1e308", b"-0.0", b"12345678901234567890123456789", b'"\\ud83d\\ude00"',
                                   b'"caf\\u00e9"', b"[" * 20 + b"1" + b"]" * 20])
def test_storable_numbers_and_text_are_kept(value):
    """A surrogate pair is one character (an emoji), a large but finite number is a number: stored as sent."""
    body = _event(value)
    response = post(Client(raise_request_exception=False), body, localstripe_signed(body, int(time.time())))
    assert response.status_code == 200, response.content
    assert StripeEvent.objects.get(event_id="evt_x").status == "ignored"
