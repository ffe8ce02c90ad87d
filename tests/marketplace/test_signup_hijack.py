"""Account pre-hijack through sign-up: confirming a sign-up needs the password chosen at that sign-up.

Sign-up tokens are stateless: each carries the address and the hash of the password typed at sign-up. An attacker
who signed up with the victim's address right after the victim made the victim receive a second "Confirm your
sign-up" e-mail; if the victim followed that one, the account was created with the attacker's password: the
victim was logged in and used it, and the attacker logged in later (found by review). Now the page and
POST /api/v1/auth/confirm/ take the password too, checked against the token's hash: the wrong one is a 400 saying
the link belongs to a sign-up with another password, and nothing is created.
"""
import re

import pytest
from django.test import Client
from rest_framework import throttling as drf_throttling
from rest_framework.test import APIClient

from marketplace.models import ApiKey, User
from marketplace.services import accounts

pytestmark = pytest.mark.django_db

REGISTER = "/api/v1/auth/register/"
CONFIRM = "/api/v1/auth/confirm/"
VICTIM = "victim@example.com"
VICTIMS_PASSWORD = "the victim's own pass 42"
ATTACKERS_PASSWORD = "the attacker's pass 1234"
ANOTHER_PASSWORD = "not the right passphrase 9"


def tokens(mailoutbox, email: str) -> list[str]:
    return [re.search(r"^The token: (\S+)$", m.body, re.M).group(1) for m in mailoutbox if m.to == [email]]


@pytest.fixture
def two_sign_ups(mailoutbox):
    """The victim signs up, then the attacker with the victim's address: two e-mails to the victim, the
    attacker's newest. Returns (the victim's token, the attacker's token)."""
    assert APIClient().post(REGISTER, {"email": VICTIM, "password": VICTIMS_PASSWORD}).status_code == 202
    attacker = APIClient(REMOTE_ADDR="198.51.100.66")
    r = attacker.post(REGISTER, {"email": VICTIM, "password": ATTACKERS_PASSWORD})
    assert r.status_code == 202 and "token" not in r.content.decode()  # the attacker learns no token
    victims, attackers = tokens(mailoutbox, VICTIM)
    assert [m.to for m in mailoutbox] == [[VICTIM], [VICTIM]]  # both mails went to the victim's address
    return victims, attackers


def assert_nothing_made():
    assert not User.objects.filter(email__iexact=VICTIM).exists() and not ApiKey.objects.exists()


def test_the_victims_password_with_the_attackers_token_is_refused_on_the_api_and_nothing_is_made(two_sign_ups):
    _victims, attackers = two_sign_ups
    r = APIClient().post(CONFIRM, {"token": attackers, "password": VICTIMS_PASSWORD})
    assert r.status_code == 400, r.content
    [message] = r.json()["password"]
    assert "another password" in message and "someone else" in message and "sign up again" in message
    assert_nothing_made()


def test_the_victims_own_link_and_password_make_the_account_and_the_attackers_password_does_not_log_in(
        two_sign_ups):
    victims, attackers = two_sign_ups
    assert APIClient().post(CONFIRM, {"token": victims, "password": ATTACKERS_PASSWORD}).status_code == 400
    assert_nothing_made()
    r = APIClient().post(CONFIRM, {"token": victims, "password": VICTIMS_PASSWORD})
    assert r.status_code == 201, r.content
    user = User.objects.get(email=VICTIM)
    assert user.check_password(VICTIMS_PASSWORD) and not user.check_password(ATTACKERS_PASSWORD)
    assert APIClient(REMOTE_ADDR="198.51.100.66").post(
        "/api/v1/auth/login/", {"email": VICTIM, "password": ATTACKERS_PASSWORD}).status_code == 400
    # The attacker's token is spent with the address (even with the attacker's password, had they the mail).
    r = APIClient().post(CONFIRM, {"token": attackers, "password": ATTACKERS_PASSWORD})
    assert r.status_code == 400 and "token" in r.json()
    assert User.objects.count() == 1 and user.check_password(VICTIMS_PASSWORD)


def test_the_victims_password_with_the_attackers_link_is_refused_on_the_page_and_nobody_is_logged_in(two_sign_ups):
    _victims, attackers = two_sign_ups
    browser = Client()
    page = browser.get(f"/accounts/confirm/{attackers}/").content.decode()
    assert re.search(r'<input[^>]*type="password"[^>]*autocomplete="current-password"', page) or re.search(
        r'<input[^>]*autocomplete="current-password"[^>]*type="password"', page)
    r = browser.post(f"/accounts/confirm/{attackers}/", {"token": attackers, "password": VICTIMS_PASSWORD})
    assert r.status_code == 400
    page = r.content.decode()
    assert "another password" in page and "someone else" in page
    assert VICTIMS_PASSWORD not in page  # a password is never shown back
    assert browser.session.get("_auth_user_id") is None
    assert_nothing_made()


def test_the_service_checks_the_password_before_anything_is_made(two_sign_ups):
    victims, attackers = two_sign_ups
    with pytest.raises(accounts.SignupPasswordMismatch) as refused:
        accounts.user_register_confirm(token=attackers, password=VICTIMS_PASSWORD)
    assert refused.value.field == "password"
    assert_nothing_made()
    user, _key, _raw = accounts.user_register_confirm(token=victims, password=VICTIMS_PASSWORD)
    assert user.check_password(VICTIMS_PASSWORD)


def test_the_attacker_cannot_confirm_without_the_mail(two_sign_ups):
    """The token exists only in the e-mail to the address: a forged or tampered one is refused as any bad one."""
    _victims, attackers = two_sign_ups
    forged = attackers[:-8] + ("A" * 8 if not attackers.endswith("A" * 8) else "B" * 8)
    for token in ("", "guess", forged):
        r = APIClient().post(CONFIRM, {"token": token, "password": ATTACKERS_PASSWORD})
        assert r.status_code == 400 and "token" in r.json()
    assert_nothing_made()


def test_confirm_without_a_password_names_it(two_sign_ups):
    victims, _attackers = two_sign_ups
    r = APIClient().post(CONFIRM, {"token": victims})
    assert r.status_code == 400 and "password" in r.json()
    r = Client().post(f"/accounts/confirm/{victims}/", {"token": victims})
    assert r.status_code == 400
    assert_nothing_made()


def test_guessing_the_password_of_a_token_goes_through_the_auth_rate(two_sign_ups):
    """Each confirm counts in the client's `auth` budget: a token cannot be a way to guess its password."""
    victims, _attackers = two_sign_ups
    rate = drf_throttling.ScopedRateThrottle.THROTTLE_RATES["auth"]
    limit, _ = drf_throttling.ScopedRateThrottle().parse_rate(rate)
    guesser = APIClient(REMOTE_ADDR="198.51.100.77")
    answers = [guesser.post(CONFIRM, {"token": victims, "password": f"guess number {n}"}).status_code
               for n in range(limit)]
    assert answers == [400] * limit
    r = guesser.post(CONFIRM, {"token": victims, "password": VICTIMS_PASSWORD})  # even the right one
    assert r.status_code == 429 and int(r["Retry-After"]) > 0
    page = Client(REMOTE_ADDR="198.51.100.77").post(f"/accounts/confirm/{victims}/",
                                                    {"token": victims, "password": VICTIMS_PASSWORD})
    assert page.status_code == 429
    assert_nothing_made()


def test_the_e_mail_says_the_link_asks_for_the_password_and_the_curl_line_sends_it(two_sign_ups, mailoutbox):
    body = mailoutbox[-1].body
    assert "password you chose" in body
    assert '"password": ' in body and "curl -X POST" in body
    assert VICTIMS_PASSWORD not in body and ATTACKERS_PASSWORD not in body
