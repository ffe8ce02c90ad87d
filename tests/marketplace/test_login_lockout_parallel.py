"""The log-in lock-out under parallel guesses, with real threads against the real Redis cache and PostgreSQL.

The budget is exact (core/login_throttle.py): however many guesses arrive at once, at most
LOGIN_FAILURES_PER_ACCOUNT of them for one email (LOGIN_FAILURES_PER_ADDRESS from one address) are looked at; the
others are refused (LoginLocked) before the password or code is. The reviewer's reproduction had every one of 40
parallel wrong guesses checked, and with one guess left the right password among 40 logged in.
"""
import threading
from collections import Counter

import pytest
from django.contrib.auth import authenticate
from django.contrib.auth.hashers import PBKDF2PasswordHasher
from django.db import connection
from django_otp.oath import totp

from core.login_throttle import LoginLocked, login_attempt
from marketplace.services import passwords, two_factor
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db(transaction=True)

PASSWORD = "correct horse battery staple"  # what UserFactory sets
GUESSES = 40


class SlowHasher(PBKDF2PasswordHasher):
    """A real, slow enough hash: each check takes long enough that parallel guesses overlap."""

    iterations = 100_000


@pytest.fixture(autouse=True)
def _slow_hash_no_device_delay(settings):
    settings.PASSWORD_HASHERS = [f"{__name__}.SlowHasher"]
    settings.OTP_TOTP_THROTTLE_FACTOR = 0
    settings.OTP_STATIC_THROTTLE_FACTOR = 0


def in_parallel(calls: list) -> list:
    """Each call's outcome: 'locked' (refused before the check), or what it returned."""
    barrier = threading.Barrier(len(calls))
    results: list = [None] * len(calls)

    def worker(i, call):
        try:
            barrier.wait(timeout=10)
            results[i] = call()
        except LoginLocked:
            results[i] = "locked"
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            results[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=worker, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a check hung"
    assert not [r for r in results if isinstance(r, Exception)], results
    return results


def _address(i: int) -> str:
    return f"192.0.2.{i + 1}"


def test_parallel_wrong_passwords_for_one_email_are_checked_at_most_the_limit(settings):
    user = UserFactory()
    results = in_parallel([
        (lambda i=i: authenticate(email=user.email, password=f"guess {i}", client_address=_address(i)))
        for i in range(GUESSES)])
    assert Counter(results) == {None: settings.LOGIN_FAILURES_PER_ACCOUNT,
                                "locked": GUESSES - settings.LOGIN_FAILURES_PER_ACCOUNT}
    with pytest.raises(LoginLocked):  # and the lock holds for the right password
        authenticate(email=user.email, password=PASSWORD, client_address="198.51.100.1")


def test_with_one_guess_left_only_one_of_many_parallel_guesses_is_checked(settings):
    user = UserFactory()
    for i in range(settings.LOGIN_FAILURES_PER_ACCOUNT - 1):
        assert authenticate(email=user.email, password=f"wrong {i}", client_address="198.51.100.1") is None
    results = in_parallel([
        (lambda i=i: authenticate(email=user.email, password=f"guess {i}", client_address=_address(i)))
        for i in range(GUESSES)])
    assert Counter(results) == {None: 1, "locked": GUESSES - 1}


def test_a_right_password_gives_its_place_back(settings):
    """A success is not a failure: its place in the address's counter goes back (and the email's is reset), so
    more right log-ins than the limits from one address all go through."""
    user = UserFactory()
    for _ in range(settings.LOGIN_FAILURES_PER_ADDRESS + 5):
        assert authenticate(email=user.email, password=PASSWORD, client_address="198.51.100.7") == user


def test_a_guess_refused_while_the_last_place_is_being_checked_is_told_to_retry_soon(settings):
    """Refused because the last guess is still being checked, not locked (yet): retry in a second; once that guess
    failed, the lock's own wait."""
    user = UserFactory()
    for i in range(settings.LOGIN_FAILURES_PER_ACCOUNT - 1):
        assert authenticate(email=user.email, password=f"wrong {i}", client_address="198.51.100.1") is None
    being_checked = login_attempt(account=user.email, address="198.51.100.2")
    with pytest.raises(LoginLocked) as refused:
        authenticate(email=user.email, password=PASSWORD, client_address="198.51.100.3")
    assert refused.value.retry_after == 1
    being_checked.failed()
    with pytest.raises(LoginLocked) as locked:
        authenticate(email=user.email, password=PASSWORD, client_address="198.51.100.3")
    assert locked.value.retry_after > settings.LOGIN_LOCKOUT_S - 5


def test_parallel_guesses_from_one_address_are_checked_at_most_the_address_limit(settings):
    limit = settings.LOGIN_FAILURES_PER_ADDRESS
    results = in_parallel([
        (lambda i=i: authenticate(email=f"nobody-{i}@example.com", password="guess", client_address="203.0.113.9"))
        for i in range(limit + 15)])
    assert Counter(results) == {None: limit, "locked": 15}


def test_parallel_password_checks_of_a_logged_in_user_are_checked_at_most_the_limit(settings):
    """The password typed again (password change, turning two-factor on or off, the payout account)."""
    user = UserFactory()
    results = in_parallel([
        (lambda i=i: passwords.password_check(user=user, password=f"guess {i}", client_address=_address(i)))
        for i in range(GUESSES)])
    assert Counter(results) == {False: settings.LOGIN_FAILURES_PER_ACCOUNT,
                                "locked": GUESSES - settings.LOGIN_FAILURES_PER_ACCOUNT}


def test_parallel_two_factor_codes_are_checked_at_most_the_limit(settings):
    user = UserFactory()
    device = two_factor.totp_enrol_start(user=user, password="correct horse battery staple", client_address=None)
    two_factor.totp_enrol_confirm(user=user, device_id=device.pk, code=f"{totp(device.bin_key):06d}",
                                  client_address=None)
    right = f"{totp(device.bin_key):06d}"
    wrong = f"{(int(right) + 1) % 1_000_000:06d}"

    def guess(i):
        try:
            two_factor.code_check(user=user, code=wrong, client_address=_address(i))
        except two_factor.WrongCode:
            return "wrong"
        return "right"

    results = in_parallel([(lambda i=i: guess(i)) for i in range(GUESSES)])
    assert Counter(results) == {"wrong": settings.LOGIN_FAILURES_PER_ACCOUNT,
                                "locked": GUESSES - settings.LOGIN_FAILURES_PER_ACCOUNT}
