"""The rent page's estimate in a real browser (Playwright, Debian's Chromium, the live server): the script prices
what the form has chosen from the moment the page opens, a MIG profile chosen before any click included."""
import pytest

from tests.marketplace.mig_helpers import SEVEN, make_mig_node
from tests.web.conftest import fund
from tests.web.test_browser import log_in

pytestmark = pytest.mark.slow


def test_an_all_mig_offer_is_priced_per_slice_as_soon_as_a_number_is_typed(live_server, new_page, renter):
    fund(renter)
    # Both GPUs split into 7 slices of 1g.10gb at $0.25 a slice-hour; a whole GPU would be $1.50 an hour.
    node = make_mig_node({0: SEVEN, 1: SEVEN}, {"1g.10gb": "0.25"}, gpu_count=2, price="1.500000")
    page = new_page()
    log_in(page, live_server.url, renter.email)
    page.goto(f"{live_server.url}/offers/{node.pk}/rent/")
    assert page.locator('input[name="mig_profile"][value="1g.10gb"]').is_checked()
    page.locator("#id_num_gpus").fill("2")
    estimate = page.locator('[data-est="per-hour"]')
    assert estimate.inner_text() == "$0.50"
    assert page.locator('[data-est="gpus"]').inner_text() == "2 MIG 1g.10gb slices"
    assert page.locator('[data-est="unit-price"]').inner_text() == "$0.25 per slice-hour"
    assert not page.errors


def test_the_filtered_rent_link_prices_the_profile_it_chose(live_server, new_page, renter):
    fund(renter)
    # GPU 1 is whole and free, yet the Rent link from offers filtered by a profile opens with that profile chosen.
    node = make_mig_node({0: SEVEN}, {"1g.10gb": "0.25"}, gpu_count=2, price="1.500000")
    page = new_page()
    log_in(page, live_server.url, renter.email)
    page.goto(f"{live_server.url}/offers/?mig_profile=1g.10gb")
    page.locator(f'a[href^="/offers/{node.pk}/rent/"]').first.click()
    page.locator("#id_num_gpus").wait_for()
    assert page.locator('input[name="mig_profile"][value="1g.10gb"]').is_checked()
    page.locator("#id_num_gpus").fill("3")
    assert page.locator('[data-est="per-hour"]').inner_text() == "$0.75"
    page.locator('input[name="mig_profile"][value=""]').check()
    assert page.locator('[data-est="per-hour"]').inner_text() == "$4.50"
    assert not page.errors


def test_the_balance_panel_follows_the_profile_chosen(live_server, new_page, renter, settings):
    settings.BILLING_REQUIRE_FUNDS = True
    settings.BILLING_TOP_UP_MIN_USD = 5
    fund(renter, usd=1)
    # GPU 1 whole at $1.50 an hour (an hour of it needs $0.50 more than the $1 balance); GPU 0 split at $0.25 a slice.
    node = make_mig_node({0: SEVEN}, {"1g.10gb": "0.25"}, gpu_count=2, price="1.500000")
    page = new_page()
    log_in(page, live_server.url, renter.email)
    page.goto(f"{live_server.url}/offers/{node.pk}/rent/")
    funds = page.locator("#funds")
    missing = funds.locator('[data-funds="missing_line"]')
    assert page.locator('input[name="mig_profile"][value=""]').is_checked()
    assert funds.locator('[data-funds="per_unit"]').inner_text() == "$1.50"
    assert missing.is_visible() and missing.locator('[data-funds="missing"]').inner_text() == "$0.50"

    page.locator('input[name="mig_profile"][value="1g.10gb"]').check()
    assert funds.locator('[data-funds="per_unit"]').inner_text() == "$0.25"
    assert funds.locator('[data-funds="per"]').first.inner_text() == "slice"
    assert not missing.is_visible()
    assert "warning" not in funds.get_attribute("class")

    page.locator('input[name="mig_profile"][value=""]').check()
    assert missing.is_visible() and "warning" in funds.get_attribute("class")
    assert missing.locator('[data-funds="top_up"]').get_attribute("href") == "/account/balance/?amount=5"
    assert not page.errors
