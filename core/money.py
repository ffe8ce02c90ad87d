"""Money is integers of micro-dollars (1e-6 USD); decimals exist only at the edges (API fields, pages, sentences).

Owned by no app: the API toolkit's money fields (core.api.fields) and every app's services use it.
"""
import re
from decimal import ROUND_FLOOR, ROUND_HALF_UP, Decimal

MICROS_PER_USD = 1_000_000
USD_QUANTUM = Decimal("0.000001")
# Prices as decimals: six places (micro-dollars), up to $999,999.999999.
USD_MAX_DIGITS, USD_PLACES = 12, 6
# Amounts typed in whole cents: up to $9,999,999.99.
CENTS_MAX_DIGITS, CENTS_PLACES = 9, 2

# USD in whole cents as people and clients type it: "25", "25.5", "25.00". No sign, exponent or thousands
# separator, at most seven whole digits, and a point only with decimals after it ("25." is not an amount). ASCII
# digits only, as the published schema's pattern: without re.ASCII, \d took any Unicode digit ("٥", "１０") and
# Decimal read it as the number (found by review).
_PLAIN_CENTS = re.compile(rf"\d{{1,{CENTS_MAX_DIGITS - CENTS_PLACES}}}(\.\d{{1,{CENTS_PLACES}}})?", re.ASCII)


def usd_to_micros(amount: Decimal) -> int:
    """Exact for any amount with at most six decimal places (the serializers enforce that)."""
    return int((amount * MICROS_PER_USD).to_integral_value(rounding=ROUND_HALF_UP))


def usd_bound_to_micros(amount: Decimal) -> int:
    """A most-to-pay bound (a search's maximum price) in whole micro-dollars, rounded DOWN: prices are whole
    micro-dollars, so price <= this exactly when price <= amount. usd_to_micros rounds half up, and a maximum of
    1.4999995 listed the offers at 1.500000 (found by review)."""
    return int((amount * MICROS_PER_USD).to_integral_value(rounding=ROUND_FLOOR))


def micros_to_usd(micros: int) -> Decimal:
    return (Decimal(micros) / MICROS_PER_USD).quantize(USD_QUANTUM)


def parse_cents(text: str) -> int:
    """Whole cents of a plain decimal amount of USD (spaces around it are ignored); ValueError for anything else.

    The one rule for amounts typed in cents: the API's CentsField and the pages' amount fields both parse with it.
    """
    text = text.strip()
    if not _PLAIN_CENTS.fullmatch(text):
        raise ValueError(f"{text!r} is not an amount of USD with at most two decimal places.")
    return int(Decimal(text) * 100)


def usd_text(micros: int) -> str:
    """Money in a sentence a person reads (events, e-mails, error messages): whole cents, one minus sign.

    "$1.39", "$10,000.00", "−$5.00"; a non-zero amount under a cent is "less than $0.01" ("−(less than $0.01)"
    below zero). The API's figures stay exact (micros_to_usd); only the words round. Prices per unit: usd_rate_text.
    """
    amount = micros_to_usd(micros)
    cents = amount.quantize(Decimal("0.01"), rounding=ROUND_HALF_UP)
    if cents == 0 and amount != 0:
        # A debt of a fraction of a cent reads as one too, not as the same words as a credit.
        return "−(less than $0.01)" if amount < 0 else "less than $0.01"
    return f"{'−' if cents < 0 else ''}${abs(cents):,.2f}"


def usd_text_up(micros: int) -> str:
    """An amount the renter must reach (what an hour needs, a shortfall to top up) in a sentence: usd_text of it
    rounded UP to the next whole cent. Half-up would read a shortfall of $5.004 as "$5.00", and topping up exactly
    that would leave the renter 0.4 cent short and refused again. Balances and charges stay usd_text."""
    return usd_text(-(-micros // 10_000) * 10_000)


def usd_rate_text(micros: int) -> str:
    """A price per unit (GPU-hour, slice-hour, GB-month, an hour of several GPUs) as a person reads it: every
    significant decimal of the micro-dollars, at least two, one minus sign ("$1.504", "$1.50", "$0.000125").

    Not rounded to cents: what is charged and what the filters compare is the exact price, and a rate rounded on
    the page would not agree with it ($1.504 shown as $1.50, and 2 × $1.50 = $3.01). Amounts (balances, totals,
    charges) read in cents: usd_text."""
    amount = micros_to_usd(micros)
    text = f"{abs(amount):,.{USD_PLACES}f}"
    whole, _, decimals = text.partition(".")
    decimals = decimals.rstrip("0").ljust(2, "0")
    return f"{'−' if amount < 0 else ''}${whole}.{decimals}"
