"""The log-in lock-out on the pages (web log-in, admin log-in), shared with the API; sign-up without enumeration;
the API keys page shows the keys log-ins make."""
import re
import time

import pytest
from django.test import Client
from rest_framework import throttling as drf_throttling

from marketplace.models import ApiKey, User
from marketplace.services.accounts import hash_api_key
from tests.web.conftest import PASSWORD

pytestmark = pytest.mark.django_db

WEB_LOGIN = "/accounts/login/"
ADMIN_LOGIN = "/admin/login/"
API_LOGIN = "/api/v1/auth/login/"


def web_login(client, email, password, **extra):
    return client.post(WEB_LOGIN, {"username": email, "password": password}, **extra)


def admin_login(client, email, password, **extra):
    return client.post(ADMIN_LOGIN, {"username": email, "password": password, "next": "/admin/"}, **extra)


def api_login(client, email, password, **extra):
    return client.post(API_LOGIN, {"email": email, "password": password}, content_type="application/json", **extra)


def logged_in_as(client) -> str | None:
    return client.session.get("_auth_user_id")


def errors(response) -> list[str]:
    return re.findall(r'<ul class="errorlist nonfield"[^>]*><li>(.*?)</li>', response.content.decode())


# --- web log-in -------------------------------------------------------------------------------------------------

def test_web_login_locks_an_account_after_repeated_failures_the_right_password_too(client, renter, settings):
    for _ in range(settings.LOGIN_FAILURES_PER_ACCOUNT):
        r = web_login(client, "renter@example.com", "wrong guess")
        assert r.status_code == 200 and "Please enter a correct" in r.content.decode()
    r = web_login(client, "renter@example.com", PASSWORD, REMOTE_ADDR="192.0.2.44")  # another address
    assert r.status_code == 429 and int(r["Retry-After"]) > 0
    assert errors(r) == ["Too many failed log-ins for this email or from your network. Wait 15 minutes and try "
                         "again."]
    assert 'value="renter@example.com"' in r.content.decode()  # kept, as on any form error
    assert logged_in_as(client) is None


def test_web_login_lock_out_ends(client, renter, settings):
    settings.LOGIN_LOCKOUT_S = 1
    for _ in range(settings.LOGIN_FAILURES_PER_ACCOUNT):
        web_login(client, "renter@example.com", "wrong guess")
    assert web_login(client, "renter@example.com", PASSWORD).status_code == 429
    time.sleep(1.1)
    r = web_login(client, "renter@example.com", PASSWORD)
    assert r.status_code == 302 and logged_in_as(client) == str(renter.pk)


def test_web_login_locks_an_address_trying_many_emails_whatever_it_forwards(client, renter, settings, monkeypatch):
    # The per-client request rate (scope `auth`, tests/web/test_auth_rate_pages.py) lifted: the lock-out at work.
    monkeypatch.setattr(drf_throttling.ScopedRateThrottle, "THROTTLE_RATES", {"auth": "100000/min"})
    limit = settings.LOGIN_FAILURES_PER_ADDRESS
    for n in range(limit):
        assert web_login(client, f"user{n}@example.com", "guess", HTTP_X_FORWARDED_FOR=f"198.51.100.{n}"
                         ).status_code == 200
    r = web_login(client, "renter@example.com", PASSWORD, HTTP_X_FORWARDED_FOR="198.51.100.250")
    assert r.status_code == 429 and "Too many failed log-ins" in r.content.decode()
    other = Client(REMOTE_ADDR="192.0.2.8")
    assert web_login(other, "renter@example.com", PASSWORD).status_code == 302


def test_web_login_answers_alike_for_an_unknown_email_and_a_wrong_password(client, renter):
    answers = {}
    for email in ("renter@example.com", "nobody@example.com"):
        pages = [web_login(client, email, "wrong guess") for _ in range(5)] + [web_login(client, email, PASSWORD)]
        answers[email] = [(r.status_code, errors(r)) for r in pages]
    assert answers["renter@example.com"] == answers["nobody@example.com"]
    assert answers["nobody@example.com"][-1][0] == 429


# --- admin log-in -----------------------------------------------------------------------------------------------

def test_admin_login_locks_an_account_the_right_password_too(client, operator, settings):
    for _ in range(settings.LOGIN_FAILURES_PER_ACCOUNT):
        r = admin_login(client, "ops@example.com", "wrong guess")
        assert r.status_code == 200 and "Please enter the correct" in r.content.decode()
    r = admin_login(client, "ops@example.com", PASSWORD)
    page = r.content.decode()
    assert "Too many failed log-ins for this email or from your network. Wait 15 minutes" in page
    assert logged_in_as(client) is None
    assert client.get("/admin/").status_code == 302


def test_admin_login_locks_an_address(client, operator, settings, monkeypatch):
    # The per-client request rate (scope `auth`, tests/web/test_auth_rate_pages.py) lifted: the lock-out at work.
    monkeypatch.setattr(drf_throttling.ScopedRateThrottle, "THROTTLE_RATES", {"auth": "100000/min"})
    for n in range(settings.LOGIN_FAILURES_PER_ADDRESS):
        admin_login(client, f"user{n}@example.com", "guess", HTTP_X_FORWARDED_FOR=f"198.51.100.{n}")
    assert "Wait 15 minutes" in admin_login(client, "ops@example.com", PASSWORD).content.decode()
    other = Client(REMOTE_ADDR="192.0.2.9")
    assert admin_login(other, "ops@example.com", PASSWORD).status_code == 302
    assert other.get("/admin/").status_code == 200


def test_admin_login_still_works(client, operator):
    r = admin_login(client, "Ops@Example.com", PASSWORD)
    assert r.status_code == 302 and client.get("/admin/").status_code == 200


def test_one_lock_out_for_every_login_path(client, operator):
    """Failures count together on the API, the web log-in and the admin's: guessing cannot move between them."""
    for _ in range(2):
        assert api_login(client, "ops@example.com", "wrong guess").status_code == 400
    for _ in range(2):
        web_login(client, "ops@example.com", "wrong guess")
    admin_login(client, "ops@example.com", "wrong guess")
    assert api_login(client, "ops@example.com", PASSWORD).status_code == 429
    assert web_login(client, "ops@example.com", PASSWORD).status_code == 429
    assert "Wait 15 minutes" in admin_login(client, "ops@example.com", PASSWORD).content.decode()


# --- sign-up ----------------------------------------------------------------------------------------------------

def _signup(client, email):
    return client.post("/accounts/signup/", {"email": email, "password": "a long passphrase 42"})


def test_signup_answers_alike_for_a_taken_and_a_new_email(client, renter, mailoutbox):
    taken = _signup(client, "renter@example.com")
    new = _signup(client, "new@example.com")
    assert taken.status_code == new.status_code == 200
    assert taken.content.decode().replace("renter@example.com", "X") == new.content.decode().replace(
        "new@example.com", "X")
    assert "Check your e-mail" in new.content.decode()
    assert not User.objects.filter(email="new@example.com").exists()
    assert [m.to for m in mailoutbox] == [["renter@example.com"], ["new@example.com"]]
    assert logged_in_as(client) is None


def test_signup_link_asks_before_it_creates_the_account_then_shows_the_key_once(client, mailoutbox):
    _signup(client, "new@example.com")
    link = re.search(r"http://testserver(/accounts/confirm/[^/\s]+/)", mailoutbox[-1].body).group(1)
    page = client.get(link)
    assert page.status_code == 200 and "Create my account" in page.content.decode()
    assert not User.objects.exists()  # opening the link (a mail scanner does) creates nothing
    r = client.post(link, {"token": re.search(r"^The token: (\S+)$", mailoutbox[-1].body, re.M).group(1),
                           "password": "a long passphrase 42"})
    assert r.status_code == 200 and r["Cache-Control"] == "no-store"
    raw = re.search(r'id="api-key">([^<]+)<', r.content.decode()).group(1)
    user = User.objects.get(email="new@example.com")
    assert ApiKey.objects.get(user=user).key_hash == hash_api_key(raw)
    assert client.get("/instances/").status_code == 200  # logged in
    again = Client().post(link, {"token": re.search(r"/accounts/confirm/([^/]+)/", link).group(1),
                                 "password": "a long passphrase 42"})
    assert again.status_code == 400 and "invalid, has expired, or was used already" in again.content.decode()


# --- API keys page ----------------------------------------------------------------------------------------------

def test_the_api_keys_page_shows_the_login_key_and_revokes_it(client, web, renter):
    first = api_login(client, "renter@example.com", PASSWORD).json()
    second = api_login(client, "renter@example.com", PASSWORD).json()
    page = web.get("/account/api-keys/").content.decode()
    assert second["key"]["prefix"] in page and first["key"]["prefix"] not in page
    assert web.post(f"/account/api-keys/{second['key']['id']}/revoke/").status_code == 302
    assert not ApiKey.objects.active().filter(user=renter).exists()
