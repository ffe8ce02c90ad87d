"""The retry schedule the e-mail and webhook channels share."""
from datetime import datetime, timedelta


def backoff_s(attempt: int, *, base_s: float, cap_s: float = 3600) -> float:
    """Seconds before the attempt after `attempt` (1-based): `base_s`, doubled each time, capped at `cap_s`."""
    return float(min(base_s * 2 ** (attempt - 1), cap_s))


# How early a retry may come and still be taken as due: the task's countdown starts after the attempt's next time
# was recorded, so it comes later, not earlier; this covers clocks of different workers a little apart.
EARLY_SLACK_S = 5


def not_due_yet(next_at: datetime | None, now: datetime) -> bool:
    """Whether an attempt planned for `next_at` is not due at `now`: a duplicate task (the resender's during a queue
    backlog, a redelivered message) after a failed attempt, which would attempt again at once and start a second
    retry chain, spending the attempts twice as fast (found by review). The resender queues again whatever stays
    overdue, so refusing an early task loses nothing."""
    return next_at is not None and now < next_at - timedelta(seconds=EARLY_SLACK_S)
