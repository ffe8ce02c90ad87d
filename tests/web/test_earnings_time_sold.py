"""A provider's time sold, on the earnings page and in the API: GPU time counts each GPU of an instance (a 4-GPU
instance for an hour is 4 GPU-hours; it read "1 h"), MIG slice time is counted apart by profile (a slice-hour is not a
GPU-hour), and the API's billed_seconds keeps its value (running time, each instance once) with its meaning said."""
from datetime import timedelta

import pytest
from django.db.models import F
from django.utils import timezone

from billing.models import UsageInterval
from billing.selectors import earnings_for
from marketplace.models import Instance
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.mig_helpers import SEVEN, make_mig_node
from tests.marketplace.renting_helpers import book
from tests.web.conftest import fund, logged_in

pytestmark = pytest.mark.django_db


def _billed_an_hour(instance) -> None:
    """An hour's interval, with the instance's billed seconds as the meter keeps them (the time sold is read from
    them: billing.selectors.earnings_for)."""
    end = timezone.now()
    UsageInterval.objects.create(instance=instance, started_at=end - timedelta(hours=1), ended_at=end, seconds=3600,
                                 price_per_hour_micros=instance.price_per_hour_micros, platform_fee_bps=1500,
                                 amount_micros=instance.price_per_hour_micros, fee_micros=0)
    Instance.objects.filter(pk=instance.pk).update(billed_seconds=F("billed_seconds") + 3600)


@pytest.fixture
def provider_with_sales(renter):
    provider = UserFactory(email="seller@example.com")
    fund(renter)
    whole = make_listed_node(provider, gpu_count=4)
    split = make_mig_node({0: SEVEN}, {"1g.10gb": "0.25"}, provider=provider, gpu_count=1)
    _billed_an_hour(book(renter, whole, num_gpus=4))
    _billed_an_hour(book(renter, split, num_gpus=2, mig_profile="1g.10gb"))
    return provider


def test_gpu_time_counts_every_gpu_and_slices_apart(provider_with_sales):
    e = earnings_for(user=provider_with_sales)
    assert e.seconds == 2 * 3600  # two instances an hour each
    assert e.gpu_seconds == 4 * 3600  # 4 GPUs for an hour
    assert e.mig_slice_seconds == {"1g.10gb": 2 * 3600}  # 2 slices for an hour, not GPU time


def test_the_earnings_page_says_gpu_hours_and_slice_hours(provider_with_sales):
    page = logged_in(provider_with_sales).get("/earnings/").content.decode()
    assert ('<span class="label">GPU time sold (GPU-hours)</span><span class="value">4 h</span>' in page)
    assert ('<span class="label">MIG 1g.10gb slice time sold (slice-hours)</span><span class="value">2 h</span>'
            in page)


def test_the_earnings_api_adds_the_figures_and_keeps_billed_seconds(provider_with_sales, client_for):
    body = client_for(provider_with_sales).get("/api/v1/billing/earnings/").json()
    assert body["billed_seconds"] == 2 * 3600
    assert body["gpu_seconds_sold"] == 4 * 3600
    assert body["mig_slice_seconds_sold"] == {"1g.10gb": 2 * 3600}
