"""The retry schedule the e-mail and webhook channels share."""


def backoff_s(attempt: int, *, base_s: float, cap_s: float = 3600) -> float:
    """Seconds before the attempt after `attempt` (1-based): `base_s`, doubled each time, capped at `cap_s`."""
    return float(min(base_s * 2 ** (attempt - 1), cap_s))
