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
    (-4_999, "less than $0.01"),
])
def test_usd_text(micros, text):
    assert usd_text(micros) == text
