"""An amount the renter must reach (what an hour needs, the shortfall to top up) reads rounded UP to the cent.

Found by review: a 402 rounded the shortfall half-up, so $5.004 short read "top up at least $5.00", and topping up
exactly that was refused again ("top up at least less than $0.01"). The rent page said the same.
"""

import re
from decimal import Decimal

import pytest

from core.errors import ApplicationError
from core.money import usd_text_up
from marketplace.web.renters import funds_refusal
from tests.billing.helpers import book, fund, node

pytestmark = pytest.mark.django_db


def _asked(message: str) -> str:
    match = re.search(r"top up at least \$([\d,]+\.\d\d)", message)
    assert match, message
    return match.group(1)


def test_usd_text_up_rounds_up_to_the_cent():
    assert usd_text_up(5_004_000) == "$5.01"
    assert usd_text_up(5_000_000) == "$5.00"
    assert usd_text_up(1) == "$0.01"  # never "less than $0.01" for what must be topped up
    assert usd_text_up(0) == "$0.00"


def test_topping_up_what_the_refusal_asks_for_is_enough(clock, api):
    on = node("1.501000", gpu_count=4)  # 4 GPUs: $6.004 an hour
    fund(api.user, "1.00")
    with pytest.raises(ApplicationError) as refused:
        book(api.user, on, num_gpus=4)
    assert refused.value.status_code == 402
    asked = _asked(refused.value.message)
    assert asked == "5.01", refused.value.message  # $5.004 short
    assert "one hour needs $6.01" in refused.value.message, refused.value.message
    fund(api.user, Decimal(asked))  # exactly what the renter was told to top up
    try:
        book(api.user, on, num_gpus=4)
    except ApplicationError as again:
        pytest.fail(f"refused after topping up what was asked: {again.message}")


def test_the_rent_page_asks_for_a_shortfall_that_covers_it(clock, api, client):
    on = node("1.501000", gpu_count=4)  # $6.004 an hour; balance $1.00: $5.004 short
    fund(api.user, "1.00")
    with pytest.raises(ApplicationError) as refused:
        book(api.user, on, num_gpus=4)
    words = funds_refusal(refused.value)
    assert "top up at least $5.01" in words, words  # $5.00 would leave it 0.4 cent short
    assert "of that is $6.01" in words, words
    # The rent page's funds panel: one GPU ($1.501 an hour) needs $1.51, and a $1.00 balance is $0.501 short.
    client.force_login(api.user)
    page = client.get(f"/offers/{on.pk}/rent/").content.decode()
    assert '<span data-funds="per_unit">$1.51</span>' in page, page
    assert '<span data-funds="missing">$0.51</span>' in page, page
