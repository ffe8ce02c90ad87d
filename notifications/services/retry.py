"""What the e-mail and webhook channels share: the retry schedule, and how an attempt's error is recorded."""


def backoff_s(attempt: int, *, base_s: float, cap_s: float = 3600) -> float:
    """Seconds before the attempt after `attempt` (1-based): `base_s`, doubled each time, capped at `cap_s`."""
    return float(min(base_s * 2 ** (attempt - 1), cap_s))


def recordable(text: str, *, limit: int = 500) -> str:
    """`text` as an attempt's error may be stored and shown: one line of printable characters (each other one, NUL
    and line breaks included, a space; runs of spaces one), at most `limit` long. An error often carries what the
    other side sent (a webhook receiver's reason phrase, a mail server's answer, an exception's message quoting
    either), and PostgreSQL refuses NUL in text: the attempt's recording failed, and it went unrecorded."""
    return " ".join("".join(c if c.isprintable() else " " for c in text).split())[:limit].rstrip()
