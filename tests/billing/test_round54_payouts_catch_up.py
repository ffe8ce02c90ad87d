"""Review r54 (ops, MEDIUM-1): the payout run is daily now (beat); a week whose Monday run was missed (beat down or
recreated) is paid by the next day's run, for that week and its amount, and the runs after make no second payout."""
from datetime import date, timedelta

import pytest

from billing.models import Payout
from billing.services import payouts
from tests.billing.test_payouts import _provider_with_earnings, connect  # noqa: F401 (the fixture)

pytestmark = pytest.mark.django_db

MONDAY = date(2026, 3, 9)


def test_a_week_whose_monday_run_was_missed_is_paid_by_a_later_days_run_once(clock, connect):  # noqa: F811
    provider = _provider_with_earnings(clock)
    [payout] = payouts.payouts_run(today=MONDAY + timedelta(days=2))  # Wednesday: Monday's run never happened
    assert (payout.provider_id, payout.period_start, payout.period_end) == (provider.pk, date(2026, 3, 2),
                                                                            date(2026, 3, 8))
    assert payout.status == "paid" and payout.amount_micros == 42_500_000
    for day in range(3, 7):
        payouts.payouts_run(today=MONDAY + timedelta(days=day))
    assert Payout.objects.filter(provider=provider).count() == 1
    assert len(connect.requests) == 1
