"""What a top-up has left to refund counts what Stripe no longer has: an amount under dispute or lost to a chargeback,
and refunds made in Stripe's dashboard. Before, it counted only the platform's own refunds: an operator could refund
money the card holder's bank had already taken back (found by review), or refund again what the dashboard had. A
request over what is left is a 409 naming it. Against a real localstripe; Stripe's events posted signed."""
import pytest

from billing.models import Refund
from billing.services.refunds import refundable_micros
from tests.billing.helpers import balance, fund
from tests.billing.test_disputes import PROCESSED, answer, dispute_event, refund_obj, refunded_event
from tests.billing.test_payments import _credited_top_up

pytestmark = pytest.mark.django_db

REFUNDS = "/api/v1/billing/refunds/"


def refund(client, top_up, amount: str):
    return client.post(REFUNDS, {"top_up": top_up.pk, "amount": amount, "reason": "customer asked"}, format="json")


def test_what_a_dispute_holds_cannot_be_refunded_until_it_is_won(localstripe, api, refund_operator_api):
    top_up = _credited_top_up(localstripe, api)  # $40
    fund(api.user, "100")  # other money in the wallet: the balance alone would not stop the refund
    disputed = dispute_event("evt_d", amount=1_500, intent=top_up.payment_intent_id)  # $15
    assert answer(api, disputed) == PROCESSED
    too_much = refund(refund_operator_api, top_up, "40.00")
    assert too_much.status_code == 409, too_much.content
    detail = too_much.json()["detail"]
    assert "At most $25.00" in detail and "$15.00 of it is under dispute" in detail
    assert not Refund.objects.exists()
    lost = dispute_event("evt_l", kind="charge.dispute.closed", amount=1_500, status="lost",
                         intent=top_up.payment_intent_id)
    assert answer(api, lost) == PROCESSED
    assert refund(refund_operator_api, top_up, "25.01").status_code == 409
    assert refund(refund_operator_api, top_up, "25.00").status_code == 201
    assert refundable_micros(top_up=top_up) == 0
    assert balance(api.user) == 140_000_000 - 15_000_000 - 25_000_000


def test_a_dispute_won_after_a_refund_makes_its_amount_refundable_again(localstripe, api, refund_operator_api):
    top_up = _credited_top_up(localstripe, api)  # $40
    assert refund(refund_operator_api, top_up, "10.00").status_code == 201
    assert answer(api, dispute_event("evt_d", amount=3_000, intent=top_up.payment_intent_id)) == PROCESSED
    assert refundable_micros(top_up=top_up) == 0
    assert refund(refund_operator_api, top_up, "0.01").status_code == 409
    won = dispute_event("evt_w", kind="charge.dispute.closed", amount=3_000, status="won",
                        intent=top_up.payment_intent_id)
    assert answer(api, won) == PROCESSED
    assert refundable_micros(top_up=top_up) == 30_000_000
    assert refund(refund_operator_api, top_up, "30.00").status_code == 201
    assert balance(api.user) == 0


def test_a_refund_made_in_stripes_dashboard_is_not_refundable_again(localstripe, api, refund_operator_api):
    top_up = _credited_top_up(localstripe, api)  # $40
    fund(api.user, "100")
    dashboard = refund_obj("re_dash", 1_000, intent=top_up.payment_intent_id)
    assert answer(api, refunded_event("evt_r", [dashboard], intent=top_up.payment_intent_id)) == PROCESSED
    response = refund(refund_operator_api, top_up, "40.00")
    assert response.status_code == 409 and "At most $30.00" in response.json()["detail"]
    assert refund(refund_operator_api, top_up, "30.00").status_code == 201
    assert api.get(f"/api/v1/billing/top-ups/{top_up.pk}/").json()["refunded"] == "40.000000"
