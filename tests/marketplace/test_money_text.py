"""Money in sentences people read (events, e-mails, errors): whole cents, one minus sign, never six decimals."""
import pytest

from marketplace.money import usd_text


@pytest.mark.parametrize("micros, text", [
    (25_000_000, "$25.00"),
    (24_956_756, "$24.96"),
    (24_955_000, "$24.96"),  # half a cent rounds up
    (10_000_000_000, "$10,000.00"),
    (-5_000_000, "−$5.00"),
    (0, "$0.00"),
    (14_672, "$0.01"),
    (4_999, "less than $0.01"),
    (-4_999, "−(less than $0.01)"),  # a debt reads as one, not as the same words as a credit
    (-4_000, "−(less than $0.01)"),
])
def test_usd_text(micros, text):
    assert usd_text(micros) == text


# The pages' `usd` filter is the same rule as usd_text (core.money): whole cents, rounded half-up (half a cent goes
# away from zero, as Decimal's ROUND_HALF_UP does), the minus sign before the dollar sign.
@pytest.mark.parametrize("micros, text", [
    (1_234_567, "$1.23"),  # a price per GPU-hour with six decimals reads in cents
    (1_235_000, "$1.24"),
    (1_225_000, "$1.23"),  # half-up, not half-even ($1.22)
    (-24_955_000, "−$24.96"),
    (-5_000_000, "−$5.00"),
    (0, "$0.00"),
    (999_999_999_999_999, "$1,000,000,000.00"),  # rounds up across every digit
    (-1_234_567_890_123_456, "−$1,234,567,890.12"),
    ("2490000", "$2.49"),  # a template may hand over text
    (None, "–"),
    ("", "–"),
])
def test_the_pages_usd_filter(micros, text):
    from django.template import Context, Template

    from marketplace.templatetags.marketplace_web import usd

    assert usd(micros) == text
    rendered = Template("{% load marketplace_web %}{{ m|usd }}").render(Context({"m": micros}))
    assert rendered == text


# Prices per unit (per GPU-hour, slice-hour, hour, GB-month): every significant decimal, at least two. Rounded to
# cents they disagreed with what is charged and filtered on: $1.504 showed as $1.50, and "2 GPUs × $1.50 = $3.01".
@pytest.mark.parametrize("micros, text", [
    (1_504_000, "$1.504"),
    (3_008_000, "$3.008"),
    (1_500_000, "$1.50"),
    (490_000, "$0.49"),
    (2_000_000, "$2.00"),
    (1_234_567, "$1.234567"),
    (125, "$0.000125"),
    (1_234_567_891, "$1,234.567891"),
    (0, "$0.00"),
    (-4_000, "−$0.004"),
    ("2490000", "$2.49"),
    (None, "–"),
])
def test_the_pages_usd_rate_filter(micros, text):
    from django.template import Context, Template

    from core.money import usd_rate_text
    from marketplace.templatetags.marketplace_web import usd_rate

    assert usd_rate(micros) == text
    if micros not in (None, "2490000"):
        assert usd_rate_text(micros) == text
    rendered = Template("{% load marketplace_web %}{{ m|usd_rate }}").render(Context({"m": micros}))
    assert rendered == text
