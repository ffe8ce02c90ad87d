"""A statement's refund lines are its refunds total: one line per time a refund's money left the balance (found by
review).

The refunds total counts every hold and every debit of a refund in the month, and the lines listed a refund once if
its hold or its debit fell in the month. A refund held, not made (its hold given back) and then made at Stripe after
all (debited from the wallet) moves its money out twice and back once: the total counted it twice and the lines once
("refund lines sum 15000000 != refunds total 30000000"), and across a month's end it was listed in both months. The
page dated each line by the refund's creation, not by when its money moved. Now each hold and each debit is a line of
its own in the month it was posted, dated so, in the API and on the page alike; the release is the adjustment.
"""
import re
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.db import transaction

from billing.models import Refund, RefundStatus
from billing.services.refunds import REFUND_RELEASED_NOTE, _refund_reserve, refund_not_made, stripe_refund_apply
from tests.billing.helpers import balance
from tests.billing.test_disputes import credited_top_up
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db
ROW = re.compile(r'<tr><td>([^<]*)</td><td>(Refund of top-up #\d+[^<]*)</td><td class="num">−\$([\d,.]+)</td></tr>')


def _held_released_made(clock, user, *, hold_at: datetime, release_at: datetime, made_at: datetime) -> Refund:
    """The reviewer's sequence: $40 topped up, $15 of it held for a refund, the hold given back (Stripe made none,
    the follow-up found), then Stripe's event: made after all (debited from the wallet)."""
    top_up = credited_top_up(user, 40_000_000, intent="pi_statement")
    clock.now = hold_at
    refund = _refund_reserve(top_up=top_up, amount_micros=15_000_000, reason="asked",
                             created_by=UserFactory(is_staff=True), customer_note="", idempotency_key="",
                             request_fingerprint="")
    clock.now = release_at
    assert refund_not_made(refund_id=refund.pk, failure_message="The payment provider made no refund for it.")
    clock.now = made_at
    with transaction.atomic():
        stripe_refund_apply(stripe_refund={"id": "re_late", "object": "refund", "status": "succeeded", "amount": 1_500,
                                           "currency": "usd", "metadata": {"refund_id": str(refund.pk)}})
    refund.refresh_from_db()
    assert refund.status == RefundStatus.SUCCEEDED and balance(user) == 25_000_000
    return refund


def _month(api, client, month: str) -> dict:
    """The month's statement from the API, checked against itself and against the page: the lines sum to the totals,
    the totals to the closing balance, and the page lists the API's refund lines, each at its own time."""
    statement = api.get(f"/api/v1/billing/statements/{month}/").json()
    refunds = statement["refund_lines"]
    assert sum(Decimal(line["amount"]) for line in refunds) == Decimal(statement["refunds"])
    assert sum(Decimal(line["amount"]) for line in statement["adjustment_lines"]) == Decimal(statement["adjustments"])
    assert Decimal(statement["closing_balance"]) == (
        Decimal(statement["opening_balance"]) + Decimal(statement["top_ups"]) - Decimal(statement["usage"])
        - Decimal(statement["storage"]) - Decimal(statement["refunds"]) + Decimal(statement["adjustments"]))
    [summary] = [m for m in api.get("/api/v1/billing/statements/").json() if m["month"] == month]
    assert summary == {key: statement[key] for key in summary}
    client.force_login(api.user)  # now: the clock moved since any earlier log-in
    response = client.get(f"/account/statements/{month}/")
    assert response.status_code == 200
    page = response.content.decode()
    rows = ROW.findall(page)
    assert [(at, Decimal(amount)) for at, _, amount in rows] == [
        (f"{datetime.fromisoformat(line['debited_at']):%Y-%m-%d %H:%M}", Decimal(line["amount"])) for line in refunds]
    if refunds:
        assert f'Refunds to your card</span><span class="value">−${Decimal(statement["refunds"]):,.2f}' in page
    statement["page_rows"] = [what for _, what, _ in rows]
    return statement


def test_held_given_back_and_made_after_all_in_one_month_is_two_lines_that_sum_to_the_refunds(clock, api, client):
    refund = _held_released_made(clock, api.user, hold_at=datetime(2026, 3, 3, 9, 0, tzinfo=UTC),
                                 release_at=datetime(2026, 3, 3, 9, 30, tzinfo=UTC),
                                 made_at=datetime(2026, 3, 5, 14, 0, tzinfo=UTC))
    march = _month(api, client, "2026-03")
    assert (march["refunds"], march["adjustments"], march["closing_balance"]) == (
        "30.000000", "15.000000", "25.000000")  # out twice, back once: $15 refunded, as the balance says
    assert [(line["id"], line["kind"], line["amount"], line["given_back"], line["debited_at"])
            for line in march["refund_lines"]] == [
        (refund.pk, "hold", "15.000000", True, "2026-03-03T09:00:00Z"),
        (refund.pk, "debit", "15.000000", False, "2026-03-05T14:00:00Z")]
    assert {(line["status"], line["refunded_at"]) for line in march["refund_lines"]} == {
        ("succeeded", "2026-03-05T14:00:00Z")}
    assert [(line["amount"], line["note"]) for line in march["adjustment_lines"]] == [
        ("15.000000", REFUND_RELEASED_NOTE)]
    hold_row, debit_row = march["page_rows"]
    assert "then given back: not made at the time; made later, on its own line" in hold_row
    assert "(made after all, after the amount held for it went back to your balance)" in debit_row


def test_held_and_given_back_in_one_month_and_made_the_next_is_a_line_in_each(clock, api, client):
    refund = _held_released_made(clock, api.user, hold_at=datetime(2026, 3, 31, 23, 0, tzinfo=UTC),
                                 release_at=datetime(2026, 3, 31, 23, 30, tzinfo=UTC),
                                 made_at=datetime(2026, 4, 1, 10, 0, tzinfo=UTC))
    march, april = _month(api, client, "2026-03"), _month(api, client, "2026-04")
    assert (march["refunds"], march["adjustments"], march["closing_balance"]) == ("15.000000", "15.000000",
                                                                                 "40.000000")
    assert [(line["id"], line["kind"], line["debited_at"]) for line in march["refund_lines"]] == [
        (refund.pk, "hold", "2026-03-31T23:00:00Z")]
    assert (april["opening_balance"], april["refunds"], april["adjustments"], april["closing_balance"]) == (
        "40.000000", "15.000000", "0.000000", "25.000000")
    assert [(line["id"], line["kind"], line["debited_at"]) for line in april["refund_lines"]] == [
        (refund.pk, "debit", "2026-04-01T10:00:00Z")]  # dated when debited, not when the refund was asked for


def test_held_in_one_month_and_given_back_and_made_the_next(clock, api, client):
    """The hold in March (its line there, pending at the time, given back since), its release and the debit in
    April: April's refunds are the debit, its adjustments the release."""
    refund = _held_released_made(clock, api.user, hold_at=datetime(2026, 3, 31, 23, 0, tzinfo=UTC),
                                 release_at=datetime(2026, 4, 1, 0, 30, tzinfo=UTC),
                                 made_at=datetime(2026, 4, 2, 8, 0, tzinfo=UTC))
    march, april = _month(api, client, "2026-03"), _month(api, client, "2026-04")
    assert (march["refunds"], march["adjustments"], march["closing_balance"]) == ("15.000000", "0.000000",
                                                                                 "25.000000")
    assert [(line["kind"], line["given_back"]) for line in march["refund_lines"]] == [("hold", True)]
    assert (april["refunds"], april["adjustments"], april["closing_balance"]) == ("15.000000", "15.000000",
                                                                                 "25.000000")
    assert [(line["id"], line["kind"], line["given_back"]) for line in april["refund_lines"]] == [
        (refund.pk, "debit", False)]


def test_a_refund_held_and_made_is_one_line_and_one_pending_says_so(clock, api, client):
    """The usual ways: held then made at Stripe (its hold goes to payment clearing, the wallet not touched again):
    one line; still pending: one line saying it is being made."""
    from billing.services.refunds import refund_confirm

    top_up = credited_top_up(api.user, 40_000_000, intent="pi_usual")
    made, pending = (_refund_reserve(top_up=top_up, amount_micros=amount, reason="asked",
                                     created_by=UserFactory(is_staff=True), customer_note="", idempotency_key="",
                                     request_fingerprint="") for amount in (10_000_000, 5_000_000))
    clock.advance(hours=1)
    refund_confirm(refund_id=made.pk, stripe_refund_id="re_made")
    month = _month(api, client, "2026-03")
    assert month["refunds"] == "15.000000" and month["adjustment_lines"] == []
    assert [(line["id"], line["kind"], line["status"], line["given_back"]) for line in month["refund_lines"]] == [
        (made.pk, "hold", "succeeded", False), (pending.pk, "hold", "pending", False)]
    assert "(" not in month["page_rows"][0] and "(held for it: being made to your card)" in month["page_rows"][1]


def test_a_refund_made_from_its_hold_then_failed_at_stripe_reads_given_back(clock, api, client):
    """Made from its hold (hold -> payment clearing), then failed at Stripe: the refund's reversal (which names the
    refund's transaction, not the hold's) puts the money back in the wallet, and the hold line said given_back false
    and read as a plain refund (found by review)."""
    from billing.services.refunds import refund_confirm

    top_up = credited_top_up(api.user, 40_000_000, intent="pi_failed_late")
    refund = _refund_reserve(top_up=top_up, amount_micros=15_000_000, reason="asked",
                             created_by=UserFactory(is_staff=True), customer_note="", idempotency_key="",
                             request_fingerprint="")
    clock.advance(hours=1)
    refund_confirm(refund_id=refund.pk, stripe_refund_id="re_1")
    clock.advance(hours=1)
    with transaction.atomic():
        stripe_refund_apply(stripe_refund={"id": "re_1", "object": "refund", "status": "failed", "amount": 1_500,
                                           "currency": "usd", "metadata": {"refund_id": str(refund.pk)}})
    refund.refresh_from_db()
    assert refund.status == RefundStatus.FAILED and balance(api.user) == 40_000_000
    month = _month(api, client, "2026-03")
    assert [(line["kind"], line["status"], line["given_back"]) for line in month["refund_lines"]] == [
        ("hold", "failed", True)]
    assert "(not made: the amount went back to your balance)" in month["page_rows"][0]
