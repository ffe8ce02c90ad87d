"""The lock-out for password guessing, shared by every log-in path through the cache (Redis).

Two kinds of counters, each a fixed window that opens with its first failure: failed log-ins for one email
address (hashed; counted the same whether an account has it or not, so a lock-out tells nothing about which
addresses have accounts) and failed log-ins from one client address (core.client_address; an IPv6 /64). When a
counter reaches its limit (LOGIN_FAILURES_PER_ACCOUNT, LOGIN_FAILURES_PER_ADDRESS) within LOGIN_FAILURE_WINDOW_S,
that email or address is locked for LOGIN_LOCKOUT_S: every attempt is refused before the password is looked at,
the right password too, so guessing on cannot tell a right guess from a wrong one.

Why a fixed window and a lock: the limit is an exact budget per window (at most N guesses, then a known wait to
tell people), and it costs two cache operations per failure. A success resets the email's counter, never the
address's: an attacker's own successful log-ins must not buy more guesses against others.

The answer to a locked attempt (a 429 with Retry-After on the API, a form error saying how long to wait on the
pages) is each path's business: see marketplace/auth.py.
"""
from __future__ import annotations

import hashlib
import math
import time

from django.conf import settings
from django.core.cache import cache

from core.client_address import throttle_ident

PREFIX = "login-throttle"


class LoginLocked(Exception):
    """Log-ins for this email or from this address are refused for `retry_after` more seconds."""

    def __init__(self, retry_after: int):
        super().__init__(f"log-ins locked for {retry_after} s")
        self.retry_after = retry_after

    @property
    def minutes(self) -> int:
        return max(1, math.ceil(self.retry_after / 60))


def normalize_account(account: str) -> str:
    return (account or "").strip().lower()


def _counters(account: str, address: str | None) -> list[tuple[str, int]]:
    """(cache key, limit) of each counter that an attempt for `account` from `address` counts in."""
    digest = hashlib.sha256(normalize_account(account).encode()).hexdigest()
    counters = [(f"{PREFIX}:account:{digest}", settings.LOGIN_FAILURES_PER_ACCOUNT)]
    if address:
        counters.append((f"{PREFIX}:address:{throttle_ident(address)}", settings.LOGIN_FAILURES_PER_ADDRESS))
    return counters


def login_check(*, account: str, address: str | None) -> None:
    """Raise LoginLocked when log-ins for `account` or from `address` are locked."""
    locks = cache.get_many([f"{key}:locked" for key, _ in _counters(account, address)])
    until = max(locks.values(), default=0)
    left = until - time.time()
    if left > 0:
        raise LoginLocked(math.ceil(left))


def _count(key: str, window: int) -> int:
    cache.add(key, 0, timeout=window)  # opens the window; no-op while it is open
    try:
        return cache.incr(key)
    except ValueError:  # the window closed between the two calls
        cache.add(key, 1, timeout=window)
        return 1


def login_failed(*, account: str, address: str | None) -> None:
    """Count a failed log-in; lock what reached its limit."""
    lockout = settings.LOGIN_LOCKOUT_S
    for key, limit in _counters(account, address):
        if _count(f"{key}:failures", settings.LOGIN_FAILURE_WINDOW_S) >= limit:
            # add, not set: a lock runs its course from the failure that set it, and is never extended.
            cache.add(f"{key}:locked", time.time() + lockout, timeout=lockout)
            cache.delete(f"{key}:failures")


def login_succeeded(*, account: str) -> None:
    """Forget the email's failures (not the address's)."""
    key, _ = _counters(account, None)[0]
    cache.delete(f"{key}:failures")


def _mail_allowed(kind: str, account: str, limit: int, window: int) -> bool:
    digest = hashlib.sha256(normalize_account(account).encode()).hexdigest()
    return _count(f"{PREFIX}:{kind}-mail:{digest}", window) <= limit


def signup_mail_allowed(*, account: str) -> bool:
    """May one more sign-up e-mail go to this address? At most SIGNUP_EMAILS_PER_ADDRESS per
    SIGNUP_EMAIL_WINDOW_S, whoever asks and from wherever: the sign-up form must not be a way to flood someone's
    mailbox. The caller answers the same either way (no account is revealed); only the e-mail is not sent."""
    return _mail_allowed("signup", account, settings.SIGNUP_EMAILS_PER_ADDRESS, settings.SIGNUP_EMAIL_WINDOW_S)


def password_reset_mail_allowed(*, account: str) -> bool:
    """The same for password-reset e-mails: at most PASSWORD_RESET_EMAILS_PER_ADDRESS per
    PASSWORD_RESET_EMAIL_WINDOW_S, counted whether or not the address has an account."""
    return _mail_allowed("reset", account, settings.PASSWORD_RESET_EMAILS_PER_ADDRESS,
                         settings.PASSWORD_RESET_EMAIL_WINDOW_S)
