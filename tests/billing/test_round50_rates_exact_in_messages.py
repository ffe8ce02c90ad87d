"""Prices per hour in messages read exact (usd_rate_text), as the pages and the API show them.

Found by review: the low-balance warning, the 402 of a booking and the price-cut e-mail rounded the rate to cents
($1.504 read "$1.50"; a $0.10/h instance cut to $0.096/h read "it costs $0.10/h instead of $0.10/h").
"""

import pytest

from billing.models import BillingEvent
from billing.services.enforcement import balances_enforce
from billing.services.low_balance import LowBalanceNotice
from core.errors import ApplicationError
from marketplace.services.instances.pricing import instance_price_cut
from tests.billing.helpers import book, fund, node, running

pytestmark = pytest.mark.django_db


def test_low_balance_warning_says_the_rate_the_balance_page_says(clock, api, client, settings):
    settings.BILLING_LOW_BALANCE_WARNING_S = 2 * 3600
    fund(api.user, "1.60")
    running(api.user, node("1.504000"))
    assert balances_enforce().warned == 1
    client.force_login(api.user)
    page = client.get("/account/balance/").content.decode()
    assert "<strong>$1.504</strong> per hour" in page  # the balance page: the exact rate
    [warning] = BillingEvent.objects.filter(user=api.user, kind="low_balance")
    assert warning.data["per_hour"] == "1.504000"
    assert "$1.504 per hour" in warning.message, warning.message  # the same figure, in the event and e-mail


def test_a_raise_notice_says_the_exact_rate():
    notice = LowBalanceNotice(balance_micros=2_000_000, rate_micros=1_504_000, seconds_left=4787, stop_not_before=None)
    assert "$1.504/h for your instances and storage" in notice.note(), notice.note()


def test_booking_refusal_says_the_rate_the_offer_says(clock, api):
    on = node("1.504000")
    with pytest.raises(ApplicationError) as refused:
        book(api.user, on)
    assert refused.value.status_code == 402
    assert "This instance costs $1.504/h" in refused.value.message, refused.value.message


def test_booking_refusal_with_instances_running_says_exact_rates(clock, api):
    fund(api.user, "1.60")
    running(api.user, node("1.504000"))
    with pytest.raises(ApplicationError) as refused:
        book(api.user, node("0.333333"))
    message = refused.value.message
    assert "storage cost $1.504/h; with this one $1.837333/h" in message, message


@pytest.mark.parametrize(("ratio", "new"), [(0.94, "$0.094/h"), (0.96, "$0.096/h")])
def test_price_cut_event_names_the_new_price(clock, api, ratio, new):
    fund(api.user, "10")
    instance = running(api.user, node("0.100000"))
    assert instance_price_cut(instance_id=instance.pk, ratio=ratio, reason="slower than claimed") is not None
    [event] = BillingEvent.objects.filter(user=api.user, kind="price_cut")
    assert f"it costs {new} instead of $0.10/h" in event.message, event.message
