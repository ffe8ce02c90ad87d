"""Times on the renters' pages say they are UTC, as the other pages do (instances, SSH keys, API keys), and the usage
page's "To" keeps its date when an interval ends on another day than it started."""
import re
from datetime import UTC, datetime

import pytest

from billing.models import UsageInterval
from marketplace.services.ssh_keys import ssh_key_create
from tests.factories import api_key_for, make_listed_node
from tests.marketplace.renting_helpers import book, ed25519_key

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(("path", "headers"), [
    ("/instances/", ["Created (UTC)"]),
    ("/account/ssh-keys/", ["Added (UTC)"]),
    ("/account/api-keys/", ["Expires (UTC)", "Created (UTC)", "Last used (UTC)"]),
    ("/account/usage/", ["From (UTC)", "To (UTC)"]),
])
def test_time_columns_say_utc(web, funded_renter, path, headers):
    instance = book(funded_renter, make_listed_node())
    ssh_key_create(user=funded_renter, public_key=ed25519_key())
    api_key_for(funded_renter)
    UsageInterval.objects.create(instance=instance, started_at=datetime(2026, 3, 1, 23, 59, 30, tzinfo=UTC),
                                 ended_at=datetime(2026, 3, 2, 0, 0, 30, tzinfo=UTC), seconds=60,
                                 price_per_hour_micros=1_500_000, platform_fee_bps=1500, amount_micros=25_000,
                                 fee_micros=3_750)
    page = web.get(path).content.decode()
    for header in headers:
        assert f'<th scope="col">{header}</th>' in page, header


def test_an_interval_across_midnight_keeps_the_date_it_ends(web, funded_renter):
    instance = book(funded_renter, make_listed_node())
    for start, end in [((1, 23, 59, 30), (2, 0, 0, 30)), ((2, 10, 0, 0), (2, 10, 1, 0))]:
        UsageInterval.objects.create(
            instance=instance, started_at=datetime(2026, 3, *start, tzinfo=UTC),
            ended_at=datetime(2026, 3, *end, tzinfo=UTC), seconds=60, price_per_hour_micros=1_500_000,
            platform_fee_bps=1500, amount_micros=25_000, fee_micros=3_750)
    page = web.get("/account/usage/").content.decode()
    cells = re.findall(r'<td data-label="To">([^<]*)</td>', page)
    assert sorted(cells) == ["10:01:00", "2026-03-02 00:00:30"]
