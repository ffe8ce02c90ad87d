"""A top-up's credited_at (and a payout's created_at) is its ledger transaction's moment, not a second clock read.

Found by review: a top-up credited at 23:59:59.999 on November 30 whose ledger writes took a few ms was counted in
November's statement (placed by its transaction) and dated December 1 there (by credited_at).
"""

from datetime import UTC, datetime

import pytest

from billing.models import BillingProfile, TopUp, TopUpStatus
from billing.services import payments, payouts
from billing.services import payouts as payouts_module
from billing.services import top_ups as top_ups_module
from marketplace.services import instances as svc
from tests.billing.helpers import fund, node, running
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

BEFORE_MIDNIGHT = datetime(2026, 11, 30, 23, 59, 59, 999_000, tzinfo=UTC)
AFTER_MIDNIGHT = datetime(2026, 12, 1, 0, 0, 0, 2_000, tzinfo=UTC)


def _credit_across_midnight(clock, monkeypatch, user, intent: str) -> TopUp:
    clock.now = BEFORE_MIDNIGHT
    real_post = top_ups_module.ledger_post

    def post_then_time_passes(**kwargs):
        result = real_post(**kwargs)
        clock.now = AFTER_MIDNIGHT  # the ledger's writes took 3 ms
        return result

    monkeypatch.setattr(top_ups_module, "ledger_post", post_then_time_passes)
    top_up = TopUp.objects.create(
        user=user, amount_micros=25_000_000, status=TopUpStatus.PROCESSING, payment_intent_id=intent
    )
    payments.top_up_credit(top_up_id=top_up.pk, payment_intent_id=intent, amount_micros=25_000_000)
    top_up.refresh_from_db()
    return top_up


def test_top_up_listed_in_a_month_is_dated_in_that_month(clock, api, monkeypatch):
    top_up = _credit_across_midnight(clock, monkeypatch, api.user, "pi_midnight")
    assert top_up.credited_at == top_up.transaction.created_at
    nov = api.get("/api/v1/billing/statements/2026-11/").json()
    dec = api.get("/api/v1/billing/statements/2026-12/").json()
    assert nov["top_ups"] == "25.000000" and dec["top_ups"] == "0.000000"
    [line] = nov["top_up_lines"]
    assert line["credited_at"].startswith("2026-11-30"), line["credited_at"]


def test_top_up_line_on_the_statement_page_is_dated_in_its_month(clock, api, client, monkeypatch):
    top_up = _credit_across_midnight(clock, monkeypatch, api.user, "pi_midnight2")
    client.force_login(api.user)
    page = client.get("/account/statements/2026-11/").content.decode()
    assert f"Top-up #{top_up.pk}" in page
    assert "2026-11-30 23:59" in page
    assert "2026-12-01 00:00" not in page, "November's statement dates its top-up December 1"


def test_a_payout_is_dated_at_its_ledger_transaction(clock, monkeypatch):
    provider, renter = UserFactory(), UserFactory()
    BillingProfile.objects.create(user=provider, stripe_connect_account_id="acct_1TestProvider")
    fund(renter, "1000")
    instance = running(renter, node("10.000000", provider=provider))
    clock.advance(5 * 3600)
    svc.instance_stop(instance=instance)
    clock.now = BEFORE_MIDNIGHT
    real_post = payouts_module.ledger_post

    def post_then_time_passes(**kwargs):
        result = real_post(**kwargs)
        clock.now = AFTER_MIDNIGHT
        return result

    monkeypatch.setattr(payouts_module, "ledger_post", post_then_time_passes)
    period_start, period_end = payouts.payout_period(BEFORE_MIDNIGHT.date())
    payout = payouts.payout_create(provider_id=provider.pk, period_start=period_start, period_end=period_end)
    assert payout is not None
    payout.refresh_from_db()
    assert payout.created_at == payout.transaction.created_at == BEFORE_MIDNIGHT
