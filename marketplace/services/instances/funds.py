"""The funds check, as the booking and the start read it: the rule lives in marketplace.services.funds, where
volumes (marketplace.services.volumes, which the booking imports) reach it too without an import circle."""
from marketplace.services.funds import (  # noqa: F401 (the names the booking, the start and callers use)
    COMMITTED_RATE_SQL,
    COMMITTED_STATUSES,
    COMMITTED_VOLUME_STATES,
    Funds,
    InsufficientFunds,
    _check_funds,
    committed_rate_micros,
    funds_for,
    funds_of,
    funds_refuse_if_short,
)
