"""Money is integers of micro-dollars (1e-6 USD); decimals exist only at the API edge."""
from decimal import ROUND_HALF_UP, Decimal

MICROS_PER_USD = 1_000_000
USD_QUANTUM = Decimal("0.000001")


def usd_to_micros(amount: Decimal) -> int:
    """Exact for any amount with at most six decimal places (the serializers enforce that)."""
    return int((amount * MICROS_PER_USD).to_integral_value(rounding=ROUND_HALF_UP))


def micros_to_usd(micros: int) -> Decimal:
    return (Decimal(micros) / MICROS_PER_USD).quantize(USD_QUANTUM)
