"""The per-client `auth` rate on the pages that hash a password or send e-mail to a typed address (sign-up, its
confirmation, log-in, password reset): the API's sign-up and log-in budget (scope `auth`, AUTH_THROTTLE_RATE), in
the same counter per client address. The per-address limits alone let one client mail any number of addresses
and make the platform hash a password for each sign-up.

Each test has its own client addresses (TEST-NET-3, 2001:db8::/32) and the cache is cleared before every test
(tests/conftest.py), so no budget is shared with another test."""
import re

import pytest
from django.conf import settings as django_settings
from django.contrib.auth.hashers import make_password
from django.test import Client
from rest_framework import throttling as drf_throttling

from marketplace.services import accounts as account_svc
from tests.web.conftest import PASSWORD

pytestmark = pytest.mark.django_db

SIGNUP = "/accounts/signup/"
RESET = "/accounts/password/reset/"
LOGIN = "/accounts/login/"
API_REGISTER = "/api/v1/auth/register/"
NEW_PASSWORD = "a long enough pass 42x"


def auth_limit() -> int:
    rate = django_settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"]["auth"]
    assert drf_throttling.ScopedRateThrottle.THROTTLE_RATES["auth"] == rate
    num_requests, _ = drf_throttling.ScopedRateThrottle().parse_rate(rate)
    return num_requests


def signup(client, email, **extra):
    return client.post(SIGNUP, {"email": email, "password": NEW_PASSWORD}, **extra)


def reset(client, email, **extra):
    return client.post(RESET, {"email": email}, **extra)


def refused(response) -> bool:
    page = response.content.decode()
    return (response.status_code == 429 and int(response["Retry-After"]) > 0 and "Too many requests" in page
            and re.search(r"Wait \d+ seconds? and try again", page) is not None)


def without_numbers(response) -> str:
    """The page less its digits (the seconds to wait, the CSRF token's form), to compare two answers."""
    page = re.sub(r'name="csrfmiddlewaretoken" value="[^"]*"', "", response.content.decode())
    return re.sub(r"\d+", "N", page)


@pytest.fixture
def hashed(monkeypatch):
    """How many passwords sign-up hashed (the service's make_password, counted; it still hashes)."""
    calls = []

    def counting(password, *args, **kwargs):
        calls.append(password)
        return make_password(password, *args, **kwargs)

    monkeypatch.setattr(account_svc, "make_password", counting)
    return calls


def test_one_client_signs_up_at_most_the_rate_then_gets_a_429_before_hashing_or_mail(renter, mailoutbox, hashed):
    client = Client(REMOTE_ADDR="203.0.113.21")
    limit = auth_limit()
    for n in range(limit):  # a forged X-Forwarded-For each time changes nothing (no trusted proxy)
        r = signup(client, f"target{n}@example.org", HTTP_X_FORWARDED_FOR=f"198.51.100.{n}")
        assert r.status_code == 200 and "Check your e-mail" in r.content.decode()
    assert len(mailoutbox) == len(hashed) == limit

    new = signup(client, "one-more@example.org", HTTP_X_FORWARDED_FOR="198.51.100.250")
    taken = signup(client, renter.email)
    assert refused(new) and refused(taken)
    assert without_numbers(new) == without_numbers(taken)  # nothing says whether the address has an account
    assert "one-more@example.org" not in new.content.decode()
    assert len(mailoutbox) == len(hashed) == limit  # refused before the password was hashed or a mail sent
    assert client.get(SIGNUP).status_code == 200  # the page itself still opens

    other = Client(REMOTE_ADDR="203.0.113.22")  # another client has its own budget
    assert signup(other, "someone@example.org").status_code == 200 and len(mailoutbox) == limit + 1


def test_one_client_asks_for_at_most_the_rate_of_reset_links_then_gets_a_429_before_mail(renter, mailoutbox):
    client = Client(REMOTE_ADDR="203.0.113.31")
    limit = auth_limit()
    for n in range(limit):
        r = reset(client, f"target{n}@example.org")
        assert r.status_code == 302 and r["Location"] == "/accounts/password/reset/sent/"
    assert len(mailoutbox) == limit

    unknown, known = reset(client, "one-more@example.org"), reset(client, renter.email)
    assert refused(unknown) and refused(known)
    assert without_numbers(unknown) == without_numbers(known)
    assert len(mailoutbox) == limit

    other = Client(REMOTE_ADDR="203.0.113.32")
    assert reset(other, renter.email).status_code == 302 and len(mailoutbox) == limit + 1
    assert mailoutbox[-1].to == [renter.email]


def test_the_web_log_in_has_the_rate_too_on_top_of_the_lock_out(renter):
    """Right passwords (each a new browser): the lock-out counts failures only, the rate every log-in, since each
    hashes the password."""
    limit = auth_limit()
    for _ in range(limit):
        r = Client(REMOTE_ADDR="203.0.113.41").post(LOGIN, {"username": renter.email, "password": PASSWORD})
        assert r.status_code == 302
    browser = Client(REMOTE_ADDR="203.0.113.41")
    r = browser.post(LOGIN, {"username": renter.email, "password": PASSWORD})
    assert refused(r) and browser.session.get("_auth_user_id") is None
    assert Client(REMOTE_ADDR="203.0.113.42").post(
        LOGIN, {"username": renter.email, "password": PASSWORD}).status_code == 302


def test_the_admin_log_in_has_the_rate_too(operator):
    """The admin's own log-in page (/admin/login/) counts in the same budget: it had the lock-out alone."""
    limit = auth_limit()
    for _ in range(limit):
        r = Client(REMOTE_ADDR="203.0.113.51").post("/admin/login/?next=/admin/",
                                                     {"username": operator.email, "password": PASSWORD})
        assert r.status_code == 302 and r["Location"] == "/admin/"
    browser = Client(REMOTE_ADDR="203.0.113.51")
    r = browser.post("/admin/login/?next=/admin/", {"username": operator.email, "password": PASSWORD})
    assert refused(r) and browser.session.get("_auth_user_id") is None
    assert browser.get("/admin/login/").status_code == 200  # a GET is not counted
    assert Client(REMOTE_ADDR="203.0.113.52").post(
        "/admin/login/", {"username": operator.email, "password": PASSWORD}).status_code == 302


def test_the_pages_and_the_api_share_one_budget(mailoutbox):
    limit = auth_limit()
    web = Client(REMOTE_ADDR="203.0.113.51")
    for n in range(limit // 2):
        assert signup(web, f"web{n}@example.org").status_code == 200
    api = Client(REMOTE_ADDR="203.0.113.51")
    answers = [api.post(API_REGISTER, {"email": f"api{n}@example.org", "password": NEW_PASSWORD},
                        content_type="application/json").status_code for n in range(limit - limit // 2)]
    assert answers == [202] * (limit - limit // 2)
    assert api.post(API_REGISTER, {"email": "more@example.org", "password": NEW_PASSWORD},
                    content_type="application/json").status_code == 429
    assert refused(reset(web, "more@example.org")) and refused(signup(web, "more@example.org"))
    assert refused(web.post("/accounts/confirm/some-token/", {"token": "some-token"}))  # as the API's confirm
    assert len(mailoutbox) == limit


def test_an_ipv6_client_counts_by_its_64(mailoutbox):
    limit = auth_limit()
    for n in range(limit):
        assert reset(Client(REMOTE_ADDR=f"2001:db8:5:6::{n + 1:x}"), f"t{n}@example.org").status_code == 302
    assert refused(reset(Client(REMOTE_ADDR="2001:db8:5:6:ffff::1"), "more@example.org"))
    assert reset(Client(REMOTE_ADDR="2001:db8:5:7::1"), "more@example.org").status_code == 302


def test_the_rate_counts_posts_only_and_a_normal_sign_up_and_reset_still_work(renter, mailoutbox):
    client = Client(REMOTE_ADDR="203.0.113.61")
    for _ in range(auth_limit() + 1):
        assert client.get(SIGNUP).status_code == 200 and client.get(RESET).status_code == 200
    assert signup(client, "new@example.org").status_code == 200
    assert reset(client, renter.email).status_code == 302
    assert len(mailoutbox) == 2
