"""Log-in hardening: the client's address (trusted proxies only), the log-in lock-out per email and per address,
no account enumeration, API keys that log-ins rotate instead of piling up, and a cache every process shares."""
import re
import time
from unittest import mock

import pytest
from django.contrib.auth import authenticate
from django.contrib.auth.hashers import MD5PasswordHasher
from django.test import RequestFactory
from django.urls import get_resolver
from rest_framework import throttling as drf_throttling
from rest_framework.views import APIView

from config.settings.cache import cache_url
from core.api.throttling import ClientAddressMixin
from core.client_address import client_ip, throttle_ident
from core.login_throttle import LoginLocked
from marketplace.models import ApiKey, User
from tests.factories import UserFactory, api_key_for
from tests.test_settings import production_env, run_python

pytestmark = pytest.mark.django_db

LOGIN = "/api/v1/auth/login/"
REGISTER = "/api/v1/auth/register/"
KEYS = "/api/v1/api-keys/"
ME = "/api/v1/auth/me/"
PASSWORD = "correct horse battery staple"  # what UserFactory sets
GOOD_PASSWORD = "a long enough pass 42"


@pytest.fixture
def no_rate_limit(monkeypatch):
    """Lift DRF's per-address request rate on the auth endpoints, so that only the log-in lock-out is at work."""
    monkeypatch.setattr(drf_throttling.ScopedRateThrottle, "THROTTLE_RATES", {"auth": "100000/min"})


def login(client, email, password, **extra):
    return client.post(LOGIN, {"email": email, "password": password}, **extra)


# --- the client's address ---------------------------------------------------------------------------------------

def _request(remote="203.0.113.10", forwarded=None):
    extra = {"REMOTE_ADDR": remote}
    if forwarded is not None:
        extra["HTTP_X_FORWARDED_FOR"] = forwarded
    return RequestFactory().get("/", **extra)


@pytest.mark.parametrize(
    ("proxies", "remote", "forwarded", "client"),
    [
        ([], "203.0.113.10", "198.51.100.1", "203.0.113.10"),  # no trusted proxy: the header is ignored
        ([], "203.0.113.10", None, "203.0.113.10"),
        (["10.0.0.0/8"], "203.0.113.10", "198.51.100.1", "203.0.113.10"),  # not from a trusted proxy
        (["10.0.0.0/8"], "10.0.0.1", "198.51.100.1", "198.51.100.1"),
        (["10.0.0.0/8"], "10.0.0.1", "6.6.6.6, 198.51.100.1", "198.51.100.1"),  # the client's own prefix is skipped
        (["10.0.0.0/8"], "10.0.0.1", "6.6.6.6, 198.51.100.1, 10.0.0.2", "198.51.100.1"),  # two proxies
        (["10.0.0.0/8"], "10.0.0.1", "", "10.0.0.1"),  # nothing forwarded: the proxy itself
        (["10.0.0.0/8"], "10.0.0.1", "not-an-ip", "10.0.0.1"),
        (["10.0.0.0/8"], "10.0.0.1", "198.51.100.1:4711", "198.51.100.1"),
        (["10.0.0.1", "::1"], "::1", "[2001:db8::5]:443", "2001:db8::5"),
        (["10.0.0.1"], "10.0.0.1", "::ffff:198.51.100.1", "198.51.100.1"),
        ([], "", None, ""),
    ],
)
def test_the_client_address_trusts_forwarding_headers_only_from_trusted_proxies(settings, proxies, remote,
                                                                                forwarded, client):
    settings.TRUSTED_PROXIES = proxies
    assert client_ip(_request(remote, forwarded)) == client


def test_throttles_count_ipv6_clients_by_their_64():
    assert throttle_ident("2001:db8:1:2:3:4:5:6") == throttle_ident("2001:db8:1:2:ffff::1") == "2001:db8:1:2::/64"
    assert throttle_ident("198.51.100.1") == "198.51.100.1"


def test_every_api_throttle_reads_the_client_address_with_the_one_helper():
    throttled = []

    def walk(patterns):
        for pattern in patterns:
            if hasattr(pattern, "url_patterns"):
                walk(pattern.url_patterns)
                continue
            view = getattr(pattern.callback, "cls", None)
            if view is not None and issubclass(view, APIView):
                for throttle in view.throttle_classes:
                    throttled.append(view)
                    assert issubclass(throttle, ClientAddressMixin), f"{view.__name__} uses {throttle}"

    walk(get_resolver().url_patterns)
    assert throttled  # the auth views at least


# --- the API log-in lock-out ------------------------------------------------------------------------------------

def test_forged_forwarded_for_does_not_reset_the_api_login_throttle(anon):
    """60 wrong passwords, each with a new X-Forwarded-For: locked after the 5th, at DRF's default rate too."""
    UserFactory(email="me@example.com")
    codes = [login(anon, "me@example.com", f"guess {n}", HTTP_X_FORWARDED_FOR=f"198.51.100.{n}").status_code
             for n in range(60)]
    assert codes[:5] == [400] * 5
    assert set(codes[5:]) == {429}


def test_the_right_password_is_refused_during_a_lock_out_until_it_ends(anon, settings, no_rate_limit):
    settings.LOGIN_LOCKOUT_S = 2
    user = UserFactory(email="me@example.com")
    for _ in range(settings.LOGIN_FAILURES_PER_ACCOUNT):
        assert login(anon, "me@example.com", "wrong guess").status_code == 400
    r = login(anon, "Me@Example.com", PASSWORD, REMOTE_ADDR="192.0.2.200")  # another address, same account
    assert r.status_code == 429
    assert 0 < int(r.headers["Retry-After"]) <= 2
    assert "Wait 1 minute" in r.json()["detail"]
    assert not user.api_keys.exists()
    time.sleep(2.1)
    assert login(anon, "me@example.com", PASSWORD).status_code == 200


def test_the_lock_out_lasts_the_configured_time_and_says_so(anon, settings, no_rate_limit):
    UserFactory(email="me@example.com")
    for _ in range(5):
        login(anon, "me@example.com", "wrong guess")
    r = login(anon, "me@example.com", PASSWORD)
    assert r.status_code == 429
    assert settings.LOGIN_LOCKOUT_S - 5 <= int(r.headers["Retry-After"]) <= settings.LOGIN_LOCKOUT_S
    assert r.json() == {"detail": "Too many failed log-ins for this email or from your network. Wait 15 minutes "
                                  "and try again."}


def test_a_success_resets_the_account_count(anon, no_rate_limit):
    UserFactory(email="me@example.com")
    for _ in range(3):
        for _ in range(4):
            assert login(anon, "me@example.com", "wrong guess").status_code == 400
        assert login(anon, "me@example.com", PASSWORD).status_code == 200


def test_per_address_lock_out_without_a_trusted_proxy(anon, settings, no_rate_limit):
    """Many emails from one address: locked after LOGIN_FAILURES_PER_ADDRESS, whatever X-Forwarded-For says;
    another address is not."""
    UserFactory(email="me@example.com")
    limit = settings.LOGIN_FAILURES_PER_ADDRESS
    codes = [login(anon, f"user{n}@example.com", "guess", HTTP_X_FORWARDED_FOR=f"198.51.100.{n}").status_code
             for n in range(limit + 10)]
    assert codes[:limit] == [400] * limit and set(codes[limit:]) == {429}
    assert login(anon, "me@example.com", PASSWORD).status_code == 429  # from the locked address
    assert login(anon, "me@example.com", PASSWORD, REMOTE_ADDR="192.0.2.7").status_code == 200


def test_behind_a_trusted_proxy_each_client_has_its_own_budget_and_cannot_forge_another(anon, settings):
    """Through the proxy (REMOTE_ADDR 127.0.0.1, trusted), the client is the address the proxy appended."""
    settings.TRUSTED_PROXIES = ["127.0.0.0/8"]
    limit = settings.LOGIN_FAILURES_PER_ADDRESS
    # Different clients behind the proxy: none is throttled for the others' failures (DRF's rate is per client
    # too, at its default).
    for n in range(limit + 5):
        assert login(anon, f"user{n}@example.com", "guess",
                     HTTP_X_FORWARDED_FOR=f"198.51.100.{n}").status_code == 400
    # One client forging a new address in front of the one the proxy appends: still one client.
    codes = [login(anon, f"other{n}@example.com", "guess",
                   HTTP_X_FORWARDED_FOR=f"6.6.6.{n}, 203.0.113.9").status_code for n in range(limit + 5)]
    assert codes[:limit] == [400] * limit and set(codes[limit:]) == {429}
    UserFactory(email="me@example.com")
    assert login(anon, "me@example.com", PASSWORD, HTTP_X_FORWARDED_FOR="203.0.113.9").status_code == 429
    assert login(anon, "me@example.com", PASSWORD, HTTP_X_FORWARDED_FOR="203.0.113.10").status_code == 200


def test_drf_rate_behind_a_trusted_proxy_counts_the_client_not_the_proxy(anon, settings):
    settings.TRUSTED_PROXIES = ["127.0.0.1"]
    for n in range(30):  # DRF's auth rate is 20/min per client
        assert login(anon, f"user{n}@example.com", "guess", HTTP_X_FORWARDED_FOR=f"198.51.100.{n}").status_code == 400


def test_any_authenticate_call_is_behind_the_lock_out(settings):
    UserFactory(email="me@example.com")
    for _ in range(settings.LOGIN_FAILURES_PER_ACCOUNT):
        assert authenticate(email="me@example.com", password="wrong guess") is None
    with pytest.raises(LoginLocked):
        authenticate(email="me@example.com", password=PASSWORD)


# --- no enumeration ---------------------------------------------------------------------------------------------

def _hashings(fn) -> int:
    with mock.patch.object(MD5PasswordHasher, "encode", autospec=True, side_effect=MD5PasswordHasher.encode) as spy:
        fn()
    return spy.call_count


def test_unknown_email_and_wrong_password_answer_alike_failing_and_locked(anon, no_rate_limit):
    UserFactory(email="me@example.com")
    answers = {}
    for email in ("me@example.com", "nobody@example.com"):
        failures = [login(anon, email, "wrong guess") for _ in range(5)]
        locked = login(anon, email, PASSWORD)
        answers[email] = ([(r.status_code, r.json()) for r in failures], locked.status_code, locked.json())
    assert answers["me@example.com"] == answers["nobody@example.com"]
    assert answers["me@example.com"][1] == 429


def test_unknown_email_costs_the_same_password_hashing_as_a_wrong_password(anon, no_rate_limit):
    UserFactory(email="me@example.com")
    wrong = _hashings(lambda: login(anon, "me@example.com", "wrong guess"))
    unknown = _hashings(lambda: login(anon, "nobody@example.com", "wrong guess"))
    assert wrong == unknown == 1
    for email in ("me@example.com", "nobody@example.com"):
        for _ in range(4):
            login(anon, email, "wrong guess")
    # Locked: refused before any hashing, for both.
    assert _hashings(lambda: login(anon, "me@example.com", PASSWORD)) == 0
    assert _hashings(lambda: login(anon, "nobody@example.com", PASSWORD)) == 0


def test_register_answers_alike_for_a_taken_and_a_new_email_with_the_same_work(anon, mailoutbox):
    UserFactory(email="taken@example.com")
    taken = new = None

    def register_taken():
        nonlocal taken
        taken = anon.post(REGISTER, {"email": "taken@example.com", "password": GOOD_PASSWORD})

    def register_new():
        nonlocal new
        new = anon.post(REGISTER, {"email": "new@example.com", "password": GOOD_PASSWORD})

    assert _hashings(register_taken) == _hashings(register_new) == 1
    assert (taken.status_code, taken.json()) == (new.status_code, new.json())
    assert taken.status_code == 202
    assert [m.to for m in mailoutbox] == [["taken@example.com"], ["new@example.com"]]  # one e-mail each
    assert not User.objects.filter(email="new@example.com").exists()  # not before the e-mail is answered


def test_a_squatter_cannot_take_an_address_they_do_not_read(anon, mailoutbox):
    """Registering someone else's address creates nothing: the owner can still sign up with their own password."""
    anon.post(REGISTER, {"email": "victim@example.com", "password": "the squatter's pass 1"})
    anon.post(REGISTER, {"email": "victim@example.com", "password": GOOD_PASSWORD})
    token = re.search(r"^The token: (\S+)$", mailoutbox[-1].body, re.M).group(1)
    assert anon.post("/api/v1/auth/confirm/", {"token": token, "password": GOOD_PASSWORD}).status_code == 201
    assert User.objects.get(email="victim@example.com").check_password(GOOD_PASSWORD)
    # The first e-mail's token is void now: the address has its account.
    first = re.search(r"^The token: (\S+)$", mailoutbox[0].body, re.M).group(1)
    assert anon.post("/api/v1/auth/confirm/", {"token": first, "password": "the squatter's pass 1"}).status_code == 400


def test_a_sign_up_token_expires(anon, mailoutbox, settings):
    anon.post(REGISTER, {"email": "slow@example.com", "password": GOOD_PASSWORD})
    token = re.search(r"^The token: (\S+)$", mailoutbox[-1].body, re.M).group(1)
    settings.SIGNUP_CONFIRM_TTL_S = 60
    with mock.patch("time.time", return_value=time.time() + 120):
        assert anon.post("/api/v1/auth/confirm/", {"token": token, "password": GOOD_PASSWORD}).status_code == 400
    assert not User.objects.exists()


# --- log-in keys ------------------------------------------------------------------------------------------------

def test_five_logins_leave_one_login_key(anon):
    user = UserFactory(email="me@example.com")
    manual = api_key_for(user)
    keys = [login(anon, "me@example.com", PASSWORD).json() for _ in range(5)]
    active = ApiKey.objects.active().filter(user=user)
    assert sorted(active.values_list("name", flat=True)) == ["login", "test"]
    assert active.get(name="login").pk == keys[-1]["key"]["id"]
    assert all(len(k["replaced_keys"]) == 1 for k in keys[1:])
    assert bearer(anon, manual).get(ME).status_code == 200  # other keys are untouched
    listed = anon.get(KEYS).json()["results"]
    assert {k["name"] for k in listed} == {"login", "test"}


def test_each_client_name_keeps_its_own_login_key(anon):
    user = UserFactory(email="me@example.com")
    laptop = anon.post(LOGIN, {"email": "me@example.com", "password": PASSWORD, "key_name": "laptop"}).json()
    ci = anon.post(LOGIN, {"email": "me@example.com", "password": PASSWORD, "key_name": "ci"}).json()
    again = anon.post(LOGIN, {"email": "me@example.com", "password": PASSWORD, "key_name": "laptop"}).json()
    assert [k["prefix"] for k in again["replaced_keys"]] == [laptop["key"]["prefix"]]
    assert sorted(ApiKey.objects.active().filter(user=user).values_list("name", flat=True)) == ["ci", "laptop"]
    assert bearer(anon, ci["api_key"]).get(ME).status_code == 200
    assert bearer(anon, laptop["api_key"]).get(ME).status_code == 401


@pytest.mark.parametrize("key_name", ["x" * 101, "bad\nname", 7])
def test_login_key_name_is_checked(anon, key_name):
    UserFactory(email="me@example.com")
    r = anon.post(LOGIN, {"email": "me@example.com", "password": PASSWORD, "key_name": key_name})
    assert r.status_code == 400 and "key_name" in r.json()
    assert not ApiKey.objects.exists()


def bearer(client, key):
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


# --- the cache --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("cache", "broker", "expected"),
    [
        ("redis://cache:6379/3", "redis://redis:6379/0", "redis://cache:6379/3"),  # CACHE_URL wins
        ("", "redis://redis:6379/0", "redis://redis:6379/1"),
        ("", "redis://:secret@redis:6380", "redis://:secret@redis:6380/1"),
        ("", "rediss://redis:6379/4?ssl_cert_reqs=required", "rediss://redis:6379/5?ssl_cert_reqs=required"),
        ("", "redis://redis:6379/15", "redis://redis:6379/14"),
        ("", "filesystem://", ""),
        ("", "amqp://rabbit//", ""),
    ],
)
def test_the_cache_is_redis_next_to_a_redis_broker(cache, broker, expected):
    assert cache_url(cache_url=cache, broker_url=broker) == expected


SHOW_CACHE = ["-c", "import django; django.setup(); from django.conf import settings as s; "
              "print(s.CACHES['default']['BACKEND'], s.CACHES['default'].get('LOCATION'))"]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"CELERY_BROKER_URL": "redis://127.0.0.1:6379/2"}, "RedisCache redis://127.0.0.1:6379/3"),
        ({}, "LocMemCache None"),  # the first-run demo (filesystem broker): one process
    ],
)
def test_settings_pick_the_cache_from_the_environment(tmp_path, env, expected):
    result = run_python(SHOW_CACHE, {"DJANGO_SETTINGS_MODULE": "config.settings.local", **env}, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1].endswith(expected)


def test_production_refuses_a_per_process_cache(tmp_path):
    result = run_python(["-c", "import config.settings.production"],
                        production_env(CELERY_BROKER_URL="amqp://rabbit//"), tmp_path)
    assert result.returncode != 0 and "the cache is local memory" in result.stderr
    ok = run_python(["-c", "import config.settings.production"],
                    production_env(CELERY_BROKER_URL="amqp://rabbit//", CACHE_URL="redis://cache:6379/0"), tmp_path)
    assert ok.returncode == 0, ok.stderr


def test_trusted_proxies_must_be_addresses(tmp_path):
    result = run_python(["-c", "import config.settings.local"], {"TRUSTED_PROXIES": "10.0.0.0/8,proxy.internal"},
                        tmp_path)
    assert result.returncode != 0 and "TRUSTED_PROXIES: 'proxy.internal' is not an IP address" in result.stderr


def test_the_sign_up_form_cannot_flood_a_mailbox(anon, mailoutbox, no_rate_limit, settings):
    """However often someone signs an address up, it gets SIGNUP_EMAILS_PER_ADDRESS e-mails an hour, and the
    answer stays the same (nothing tells the asker that e-mails stopped)."""
    settings.SIGNUP_EMAILS_PER_ADDRESS = 3
    UserFactory(email="taken@example.com")
    answers = {anon.post(REGISTER, {"email": email, "password": GOOD_PASSWORD}).status_code
               for email in ["victim@example.com"] * 10 + ["taken@example.com"] * 10}
    assert answers == {202}
    sent = [m.to[0] for m in mailoutbox]
    assert sent.count("victim@example.com") == 3 and sent.count("taken@example.com") == 3
    anon.post(REGISTER, {"email": "other@example.com", "password": GOOD_PASSWORD})
    assert mailoutbox[-1].to == ["other@example.com"]  # per address, not for everyone
