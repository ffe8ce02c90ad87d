"""Money helpers, defined once in core.money (the API toolkit needs them and core imports no app).

Kept so that the apps' `from marketplace.money import ...` keeps working; new code imports core.money.
"""
from core.money import (
    MICROS_PER_USD,
    USD_QUANTUM,
    micros_to_usd,
    parse_cents,
    usd_rate_text,
    usd_text,
    usd_to_micros,
)

__all__ = ["MICROS_PER_USD", "USD_QUANTUM", "micros_to_usd", "parse_cents", "usd_rate_text", "usd_text",
           "usd_to_micros"]
