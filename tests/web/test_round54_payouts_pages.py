"""Review r54 (earn #5): the payouts page listed the newest 100 payouts and left the older ones out without a word
(after about two years of weekly payouts, the oldest, failed ones with their reason among them, could no longer be
seen). It lists them all now, by pages, newest first, as the usage page does."""
import re

import pytest

from billing.models import Payout
from tests.api_contract import world
from tests.factories import UserFactory
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db


def _weeks(page: str) -> list[str]:
    return re.findall(r'<tr><th scope="row">(\d{4}-\d{2}-\d{2}) – ', page)


def test_every_payout_is_on_a_page_newest_first():
    provider = UserFactory()
    made = [world.payout(provider) for _ in range(105)]
    world.payout(UserFactory())  # another provider's: on no page
    web = logged_in(provider)
    first = web.get("/payouts/").content.decode()
    assert len(_weeks(first)) == 50 and "Page 1 of 3 (105 payouts)" in first and 'href="?page=2"' in first
    seen = _weeks(first) + _weeks(web.get("/payouts/?page=2").content.decode())
    last = web.get("/payouts/?page=3").content.decode()
    seen += _weeks(last)
    expected = [f"{p.period_start:%Y-%m-%d}" for p in sorted(made, key=lambda p: p.period_start, reverse=True)]
    assert seen == expected
    assert 'href="?page=2"' in last and "Older" not in last
    oldest = Payout.objects.filter(provider=provider).order_by("period_start").first()
    assert f"{oldest.period_start:%Y-%m-%d}" in last


@pytest.mark.parametrize("page", ["x", "0", "99", "%D9%A1"])
def test_an_odd_page_number_shows_a_page(page):
    provider = UserFactory()
    for _ in range(3):
        world.payout(provider)
    response = logged_in(provider).get(f"/payouts/?page={page}")
    assert response.status_code == 200 and len(_weeks(response.content.decode())) == 3


def test_a_few_payouts_have_no_pager():
    provider = UserFactory()
    world.payout(provider)
    page = logged_in(provider).get("/payouts/").content.decode()
    assert len(_weeks(page)) == 1 and "Pages of payouts" not in page
