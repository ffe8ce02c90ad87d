"""Money is integers of micro-dollars (1e-6 USD); decimals exist only at the API edge."""
from decimal import ROUND_HALF_UP, Decimal

MICROS_PER_USD = 1_000_000
USD_QUANTUM = Decimal("0.000001")


def usd_to_micros(amount: Decimal) -> int:
    """Exact for any amount with at most six decimal places (the serializers enforce that)."""
    return int((amount * MICROS_PER_USD).to_integral_value(rounding=ROUND_HALF_UP))


def micros_to_usd(micros: int) -> Decimal:
    return (Decimal(micros) / MICROS_PER_USD).quantize(USD_QUANTUM)


def usd_text(micros: int) -> str:
    """Money in a sentence a person reads (events, e-mails, error messages): whole cents, one minus sign.

    "$1.39", "$10,000.00", "−$5.00"; a non-zero amount under a cent is "less than $0.01". The API's figures stay
    exact (micros_to_usd); only the words round.
    """
    amount = micros_to_usd(micros)
    cents = amount.quantize(Decimal("0.01"), rounding=ROUND_HALF_UP)
    if cents == 0 and amount != 0:
        return "less than $0.01"
    return f"{'−' if cents < 0 else ''}${abs(cents):,.2f}"
