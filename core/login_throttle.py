"""The lock-out for password guessing, shared by every log-in path through the cache (Redis).

Two kinds of counters, each a fixed window that opens with its first failure: failed log-ins for one email
address (hashed; counted the same whether an account has it or not, so a lock-out tells nothing about which
addresses have accounts) and failed log-ins from one client address (core.client_address; an IPv6 /64). When a
counter reaches its limit (LOGIN_FAILURES_PER_ACCOUNT, LOGIN_FAILURES_PER_ADDRESS) within LOGIN_FAILURE_WINDOW_S,
that email or address is locked for LOGIN_LOCKOUT_S: every attempt is refused before the password is looked at,
the right password too, so guessing on cannot tell a right guess from a wrong one.

Why a fixed window and a lock: the limit is an exact budget per window (at most N guesses, then a known wait to
tell people). Exact under parallel requests too: each attempt takes its place in the counters atomically (a Redis
script) before the password is looked at, and is refused when the last place is taken, even by attempts still
being checked; a success gives its place back. A success resets the email's counter, never the
address's: an attacker's own successful log-ins must not buy more guesses against others.

Every check goes `with login_attempt(...) as attempt:`, then `attempt.failed()` or `attempt.succeeded()`; an
error in between counts as a failure. The answer to a locked attempt (a 429 with Retry-After on the API, a form
error saying how long to wait on the pages) is each path's business: see marketplace/auth.py.
"""
from __future__ import annotations

import hashlib
import math
import threading
import time
from typing import Any, Protocol

from django.conf import settings
from django.contrib.auth.hashers import check_password
from django.core.cache import cache, caches
from django.core.cache.backends.redis import RedisCache

from core.client_address import throttle_ident
from core.email_address import email_canonical
from core.errors import ValidationFailed

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
    """The key of an address's counters: the mailbox it reaches (core.email_address.email_canonical), as accounts
    are looked up by it, so that another spelling of one account's address ('ſtripe.com' for stripe.com) is no fresh
    budget; in lower case when it has none (nothing can be delivered to it, nor log in with it)."""
    try:
        return email_canonical(account or "")
    except ValidationFailed:
        return (account or "").strip().lower()


def _counters(account: str, address: str | None) -> list[tuple[str, int]]:
    """(cache key, limit) of each counter that an attempt for `account` from `address` counts in."""
    digest = hashlib.sha256(normalize_account(account).encode()).hexdigest()
    counters = [(f"{PREFIX}:account:{digest}", settings.LOGIN_FAILURES_PER_ACCOUNT)]
    if address:
        counters.append((f"{PREFIX}:address:{throttle_ident(address)}", settings.LOGIN_FAILURES_PER_ADDRESS))
    return counters


# One atomic step in Redis: count the attempt in (opening the window with the first), or refuse it and count
# nothing when the limit is taken already. Reserving before the check is what makes the budget exact under
# parallel requests: a check-then-count let every guess that arrived before the first failure was counted go on.
_TAKE = """
local n = redis.call('incr', KEYS[1])
if n == 1 then redis.call('expire', KEYS[1], ARGV[1]) end
if n > tonumber(ARGV[2]) then redis.call('decr', KEYS[1]) end
return n
"""
# Give a reservation back, within the same window only (a key that expired or was reset is not made again).
_GIVE_BACK = """
if redis.call('exists', KEYS[1]) == 1 then return redis.call('decr', KEYS[1]) end
return 0
"""
_local = threading.Lock()  # the local-memory cache's stand-in for the scripts (one process only)


def _redis() -> tuple[Any, Any]:
    backend = caches["default"]
    if isinstance(backend, RedisCache):
        return backend, backend._cache.get_client(write=True)
    return backend, None


def _take(key: str, window: int, limit: int) -> int:
    """Count one more in `key`'s window unless `limit` is reached; returns the count it would make (over the
    limit: refused, nothing counted)."""
    backend, client = _redis()
    if client is not None:
        return int(client.eval(_TAKE, 1, backend.make_and_validate_key(key), window, limit))
    with _local:
        backend.add(key, 0, timeout=window)  # opens the window; no-op while it is open
        try:
            n = backend.incr(key)
        except ValueError:  # the window closed between the two calls
            backend.add(key, 1, timeout=window)
            n = 1
        if n > limit:
            backend.decr(key)
        return int(n)


def _give_back(key: str) -> None:
    backend, client = _redis()
    if client is not None:
        client.eval(_GIVE_BACK, 1, backend.make_and_validate_key(key))
        return
    with _local:
        try:
            backend.decr(key)
        except ValueError:  # the window closed or was reset meanwhile: nothing to give back
            pass


class LoginAttempt:
    """One log-in attempt holding its place in every counter: end it with failed() or succeeded()."""

    def __init__(self, account: str, taken: list[tuple[str, int, int]]):
        self._account = account
        self._taken = taken  # (counter key, limit, this attempt's place in it)
        self._done = False

    def failed(self) -> None:
        """A wrong password or code: it stays counted; the attempt that used the last guess locks."""
        if self._done:
            return
        self._done = True
        lockout = settings.LOGIN_LOCKOUT_S
        for key, limit, n in self._taken:
            if n >= limit:
                # add, not set: a lock runs its course from the failure that set it, and is never extended. Set
                # before the counter is reset, so that an attempt counted into the new window still sees it.
                cache.add(f"{key}:locked", time.time() + lockout, timeout=lockout)
                cache.delete(f"{key}:failures")

    def succeeded(self) -> None:
        """Right: the email's failures are forgotten; the address's place is given back (a success is not a
        failure), its failures kept."""
        if self._done:
            return
        self._done = True
        account_key, _ = _counters(self._account, None)[0]
        for key, _limit, _n in self._taken:
            if key == account_key:
                cache.delete(f"{key}:failures")
            else:
                _give_back(f"{key}:failures")

    def __enter__(self) -> LoginAttempt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.failed()  # ended by an error before the answer: counted as a failure (fails closed)


def login_attempt(*, account: str, address: str | None) -> LoginAttempt:
    """Take a place in the counters for `account` and `address`, before the password (or code) is looked at;
    LoginLocked when either is locked or its last guesses are taken (by attempts still being checked)."""
    window = settings.LOGIN_FAILURE_WINDOW_S
    taken: list[tuple[str, int, int]] = []
    full = False
    for key, limit in _counters(account, address):
        n = _take(f"{key}:failures", window, limit)
        if n > limit:
            full = True
            break
        taken.append((key, limit, n))
    # The locks are looked at after the counters: a lock is set before its counter is reset (failed()).
    locks = cache.get_many([f"{key}:locked" for key, _ in _counters(account, address)])
    left = max(locks.values(), default=0) - time.time()
    if full or left > 0:
        for key, _limit, _n in taken:
            _give_back(f"{key}:failures")
        # Full but not locked (yet): the attempts holding the last places are still being checked; asked again in
        # a moment, this one meets their lock if they were wrong, or a place given back if right.
        raise LoginLocked(math.ceil(left) if left > 0 else 1)
    return LoginAttempt(account, taken)


def _mail_allowed(kind: str, account: str, limit: int, window: int) -> bool:
    digest = hashlib.sha256(normalize_account(account).encode()).hexdigest()
    return _take(f"{PREFIX}:{kind}-mail:{digest}", window, limit) <= limit


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


class PasswordHolder(Protocol):
    """What password_confirm needs of a user (core imports no app's model)."""

    email: str
    password: str  # the stored hash


def password_confirm(*, user: PasswordHolder, password: str, client_address: str | None) -> bool:
    """Is this the user's password? Behind the log-in lock-out (LoginLocked), counted as a log-in: a session
    someone else got hold of must not become a way to guess the password (the change form, turning two-factor on
    or off, the payout account, an API key, an SSH key or a webhook endpoint made on a page).

    Only compared, never re-hashed: user.check_password saves a new hash when the hasher is out of date (after each
    Django upgrade raises PBKDF2's iterations), and the session hash is an HMAC of the stored hash, so every session
    of the account ended, the one that just typed the password too (found by review: turning two-factor on then
    dead-ended on a 405 after the log-in page). The hash is brought up to date at the next real log-in, whose
    login() stores the new session hash."""
    with login_attempt(account=user.email, address=client_address) as attempt:
        if check_password(password, user.password):
            attempt.succeeded()
            return True
        attempt.failed()
        return False
