"""The billing API: every endpoint, what it shows, and who may see it."""
from datetime import timedelta

import pytest

from billing.models import BillingEvent, Refund, TopUp, TopUpStatus
from billing.services import payments
from billing.services.metering import usage_meter
from marketplace.services import instances as svc
from tests.billing.helpers import fund, node, running
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

PRIVATE = [
    ("get", "/api/v1/billing/balance/"), ("get", "/api/v1/billing/usage/"), ("get", "/api/v1/billing/cards/"),
    ("post", "/api/v1/billing/cards/"), ("post", "/api/v1/billing/cards/setup-intent/"),
    ("delete", "/api/v1/billing/cards/1/"), ("get", "/api/v1/billing/top-ups/"), ("post", "/api/v1/billing/top-ups/"),
    ("get", "/api/v1/billing/top-ups/1/"), ("get", "/api/v1/billing/events/"), ("get", "/api/v1/billing/statements/"),
    ("get", "/api/v1/billing/statements/2026-03/"), ("get", "/api/v1/billing/earnings/"),
    ("get", "/api/v1/billing/payouts/"), ("get", "/api/v1/billing/profile/"), ("patch", "/api/v1/billing/profile/"),
    ("post", "/api/v1/billing/refunds/"),
]


@pytest.mark.parametrize(("method", "url"), PRIVATE)
def test_every_billing_endpoint_but_the_webhook_needs_a_login(anon, method, url):
    assert getattr(anon, method)(url, {}, format="json").status_code == 401


def test_usage_lists_your_intervals_with_filters_and_hides_everyone_elses(clock, api, other_api):
    fund(api.user, "100")
    fund(other_api.user, "100")
    on = node("3.600000", gpu_count=4)
    mine, second = running(api.user, on), running(api.user, on)
    theirs = running(other_api.user, on)
    t0 = clock.now
    for _ in range(3):
        clock.advance(60)
        usage_meter()
    rows = api.get("/api/v1/billing/usage/").json()
    assert rows["count"] == 6
    first = rows["results"][0]
    assert set(first) == {"id", "instance", "started_at", "ended_at", "seconds", "price_per_hour",
                          "platform_fee_percent", "amount", "platform_fee", "provider_earnings", "created_at"}
    assert first["seconds"] == 60 and first["amount"] == "0.060000" and first["platform_fee"] == "0.009000"
    assert first["provider_earnings"] == "0.051000" and first["platform_fee_percent"] == "15.00"
    only = api.get(f"/api/v1/billing/usage/?instance={mine.pk}").json()
    assert only["count"] == 3 and {r["instance"] for r in only["results"]} == {mine.pk}
    window = api.get("/api/v1/billing/usage/", {"since": (t0 + timedelta(seconds=90)).isoformat(),
                                                "until": (t0 + timedelta(seconds=150)).isoformat()}).json()
    assert window["count"] == 4  # the second and third minute of both instances
    assert api.get(f"/api/v1/billing/usage/?instance={theirs.pk}").json()["count"] == 0
    assert other_api.get("/api/v1/billing/usage/").json()["count"] == 3
    for bad in ("instance=abc", "since=yesterday", "bogus=1", "instance=", "page=0"):
        assert api.get(f"/api/v1/billing/usage/?{bad}").status_code == 400, bad
    assert second.pk != mine.pk


def test_events_are_private_and_filterable(api, other_api):
    fund(api.user, "5", reason="welcome")
    BillingEvent.objects.create(user=api.user, kind="low_balance", message="low")
    assert api.get("/api/v1/billing/events/").json()["count"] == 2
    [low] = api.get("/api/v1/billing/events/?kind=low_balance").json()["results"]
    assert low["message"] == "low" and low["emailed"] is False
    assert other_api.get("/api/v1/billing/events/").json()["count"] == 0
    assert api.get("/api/v1/billing/events/?kind=nonsense").status_code == 400


def test_a_price_cuts_event_shows_its_prices_but_not_the_cards_of_other_renters_it_compared(api):
    fund(api.user, "50")
    host = node("1.500000", gpu_count=4)
    instance = running(api.user, host, num_gpus=1)
    svc.instance_price_cut(instance_id=instance.pk, ratio=0.5, reason="slow", score_before=80.0,
                           cards={"GPU-mine": [80.0, 80.0], "GPU-someone-elses": [80.0, 40.0]})
    [cut] = api.get("/api/v1/billing/events/?kind=price_cut").json()["results"]
    assert cut["data"]["instance"] == instance.pk and cut["data"]["new_per_hour"] == "0.750000"
    assert "cards" not in cut["data"] and "GPU-someone-elses" not in str(cut)
    # Kept for the raise back, which compares the same cards.
    assert BillingEvent.objects.get(kind="price_cut").data["cards"]["GPU-someone-elses"] == [80.0, 40.0]


def test_a_monthly_statement_has_usage_per_instance_top_ups_refunds_and_totals_that_add_up(clock, api, other_api):
    clock.now = clock.now.replace(month=2, day=27)
    fund(api.user, "100", reason="welcome credit")
    top_up = TopUp.objects.create(user=api.user, amount_micros=50_000_000, status=TopUpStatus.PROCESSING)
    payments.top_up_credit(top_up_id=top_up.pk, payment_intent_id="pi_x", amount_micros=50_000_000)
    on = node("3.600000", gpu_count=4)
    a = running(api.user, on)
    clock.advance(hours=1)
    usage_meter()  # February: one hour of `a`, $3.60
    clock.now = clock.now.replace(month=3, day=2)
    b = running(api.user, on)
    stopped_at = clock.advance(minutes=30)
    svc.instance_stop(instance=a)  # March: `a` from Feb 27 13:00 to Mar 2 12:30, and 30 minutes of `b`
    svc.instance_stop(instance=b)
    refund = Refund.objects.create(top_up=top_up, amount_micros=10_000_000, reason="asked", created_by=other_api.user)
    payments.refund_confirm(refund_id=refund.pk, stripe_refund_id="re_test1")

    feb = api.get("/api/v1/billing/statements/2026-02/").json()
    assert (feb["opening_balance"], feb["top_ups"], feb["usage"], feb["adjustments"], feb["closing_balance"]) == (
        "0.000000", "50.000000", "3.600000", "100.000000", "146.400000")
    assert [(line["instance"], line["seconds"], line["amount"]) for line in feb["usage_lines"]] == [
        (a.pk, 3600, "3.600000")]
    assert [t["id"] for t in feb["top_up_lines"]] == [top_up.pk]
    # The customer reads the note (the default one: the test's credit gave none), never the operator's reason.
    assert feb["adjustment_lines"][0]["note"] == "A credit from the platform."
    assert "reason" not in feb["adjustment_lines"][0] and "welcome credit" not in str(feb)
    march = api.get("/api/v1/billing/statements/2026-03/").json()
    a_seconds = int((stopped_at - a.started_at).total_seconds()) - 3600
    lines = {line["instance"]: (line["seconds"], line["amount"]) for line in march["usage_lines"]}
    assert lines[b.pk] == (1800, "1.800000") and lines[a.pk][0] == a_seconds
    assert march["opening_balance"] == feb["closing_balance"] and march["refunds"] == "10.000000"
    assert [r["amount"] for r in march["refund_lines"]] == ["10.000000"]
    total = sum(float(line["amount"]) for line in march["usage_lines"])
    assert abs(float(march["usage"]) - total) < 1e-9
    opening, closing = (float(march[k]) for k in ("opening_balance", "closing_balance"))
    assert abs(opening - float(march["usage"]) - 10 - closing) < 1e-9
    assert api.get("/api/v1/billing/balance/").json()["balance"] == march["closing_balance"]
    months = api.get("/api/v1/billing/statements/").json()
    assert [m["month"] for m in months] == ["2026-03", "2026-02"]
    assert months[0]["closing_balance"] == march["closing_balance"]
    empty = other_api.get("/api/v1/billing/statements/2026-03/").json()
    assert empty["usage_lines"] == [] and empty["closing_balance"] == "0.000000"
    assert other_api.get("/api/v1/billing/statements/").json() == []
    for bad in ("2026-13", "26-03", "march", "1999-01", "\u0662\u0660\u0662\u0666-\u0660\u0663"):  # and Arabic digits
        assert api.get(f"/api/v1/billing/statements/{bad}/").status_code == 404, bad


def test_the_profile_sets_a_payout_account_and_auto_top_up(api, other_api):
    from billing.models import Card

    assert api.get("/api/v1/billing/profile/").json()["stripe_connect_account_id"] == ""
    response = api.patch("/api/v1/billing/profile/", {"stripe_connect_account_id": "acct_1Abc"}, format="json")
    assert response.status_code == 200 and response.json()["stripe_connect_account_id"] == "acct_1Abc"
    card = Card.objects.create(user=api.user, stripe_payment_method_id="pm_local_9")
    theirs = Card.objects.create(user=other_api.user, stripe_payment_method_id="pm_local_10")
    for bad in ({"stripe_connect_account_id": "bank 123"}, {"auto_top_up_enabled": True},
                {"auto_top_up_card": theirs.pk}, {"auto_top_up_amount": "1.00"}, {"unknown": 1},
                {"auto_top_up_enabled": True, "auto_top_up_card": card.pk, "auto_top_up_amount": "20.00"}):
        assert api.patch("/api/v1/billing/profile/", bad, format="json").status_code == 400, bad
    # Every problem of an auto top-up is named at once, each on its field.
    refused = api.patch("/api/v1/billing/profile/", {"auto_top_up_enabled": True}, format="json")
    assert set(refused.json()) == {"auto_top_up_card", "auto_top_up_amount", "auto_top_up_threshold"}
    assert refused.json()["auto_top_up_card"] == ["Auto top-up needs a saved card."]
    body = {"auto_top_up_enabled": True, "auto_top_up_card": card.pk, "auto_top_up_amount": "20.00",
            "auto_top_up_threshold": "5.00"}
    response = api.patch("/api/v1/billing/profile/", body, format="json")
    assert response.status_code == 200, response.content
    assert response.json() == {"stripe_connect_account_id": "acct_1Abc", "auto_top_up_enabled": True,
                               "auto_top_up_threshold": "5.00", "auto_top_up_amount": "20.00",
                               "auto_top_up_card": card.pk}
    assert api.get("/api/v1/billing/balance/").json()["auto_top_up"] == {
        "enabled": True, "threshold": "5.000000", "amount": "20.000000", "card": card.pk}
    assert other_api.get("/api/v1/billing/profile/").json()["auto_top_up_enabled"] is False


def test_auto_top_up_starts_a_charge_below_the_threshold_once(clock, api, no_task_queue,
                                                              django_capture_on_commit_callbacks):
    from billing.models import BillingProfile, Card
    from billing.tasks import usage_meter_tick

    card = Card.objects.create(user=api.user, stripe_payment_method_id="pm_local_9")
    BillingProfile.objects.create(user=api.user, auto_top_up_enabled=True, auto_top_up_card=card,
                                  auto_top_up_threshold_micros=5_000_000, auto_top_up_amount_micros=20_000_000)
    fund(api.user, "6")
    running(api.user, node("3.600000"))
    clock.advance(1800)
    for _ in range(2):
        with django_capture_on_commit_callbacks(execute=True):
            usage_meter_tick()
    [top_up] = TopUp.objects.filter(user=api.user)
    assert top_up.automatic and top_up.amount_micros == 20_000_000 and top_up.status == "pending"
    assert no_task_queue == [("top_up_charge", (top_up.pk,))]


def test_offers_and_instances_publish_the_platform_fee(api, settings):
    from decimal import Decimal

    fund(api.user, "100")
    on = node("2.000000")
    [offer] = [o for o in api.get("/api/v1/offers/").json()["results"] if o["id"] == on.pk]
    assert offer["platform_fee_percent"] == "15.00"
    instance = running(api.user, on)
    settings.PLATFORM_FEE_PERCENT = Decimal("12.5")
    body = api.get(f"/api/v1/instances/{instance.pk}/").json()
    assert body["platform_fee_percent"] == "15.00" and body["cost_so_far"] == "0.000000"
    assert api.get(f"/api/v1/offers/{on.pk}/").json()["platform_fee_percent"] == "12.50"


def test_only_operators_refund(api, refund_operator_api):
    user = UserFactory()
    top_up = TopUp.objects.create(user=user, amount_micros=10_000_000, status=TopUpStatus.PENDING)
    body = {"top_up": top_up.pk, "amount": "1.00", "reason": "x"}
    assert api.post("/api/v1/billing/refunds/", body, format="json").status_code == 403
    response = refund_operator_api.post("/api/v1/billing/refunds/", body, format="json")
    assert response.status_code == 409 and "credited" in response.json()["detail"]


def test_staff_without_the_refund_permission_cannot_refund(operator_api):
    """The admin shows a staff account without permissions nothing; the API let it refund (found by review)."""
    user = UserFactory()
    top_up = TopUp.objects.create(user=user, amount_micros=10_000_000, status=TopUpStatus.PENDING)
    response = operator_api.post("/api/v1/billing/refunds/", {"top_up": top_up.pk, "amount": "1.00", "reason": "x"},
                                 format="json")
    assert response.status_code == 403 and "billing.add_refund" in response.json()["detail"]
    assert not Refund.objects.exists()


def test_usage_filters_refuse_what_the_database_cannot_compare(api):
    for bad in ("instance=6.3e16", "instance=1.5", "since=0001-01-01T00:00:00%2B23:59", "until=soon"):
        assert api.get(f"/api/v1/billing/usage/?{bad}").status_code == 400, bad
    odd = api.get("/api/v1/billing/usage/?since=0115-01-10T06:36:47-17:36&until=4444-11-18T00:32:02Z")
    assert odd.status_code == 200 and odd.json()["count"] == 0


def test_large_balances_render(api):
    fund(api.user, "2500000.50")
    assert api.get("/api/v1/billing/balance/").json()["balance"] == "2500000.500000"
    assert api.get("/api/v1/billing/statements/").json()[0]["closing_balance"] == "2500000.500000"
