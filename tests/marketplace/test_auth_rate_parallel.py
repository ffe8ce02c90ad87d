"""The per-client `auth` rate (sign-up, its confirmation, log-in, password reset; the pages, the admin's log-in and
the API) under parallel requests, with real threads against the real Redis cache.

The rate is counted atomically (marketplace/auth_rate.py, over core/login_throttle.py's counting script): however
many requests from one client arrive at once, at most AUTH_THROTTLE_RATE of them go on. DRF's SimpleRateThrottle
read the client's history from the cache, checked it and wrote it back: 60 of 60 parallel requests passed a
20/min rate, and 40 parallel password-reset POSTs from one address all sent an e-mail (found by review).

Each test has its own client addresses (TEST-NET-3) and the cache is cleared before every test
(tests/conftest.py)."""
import threading
import time

import pytest
from django.conf import settings as django_settings
from django.db import connection
from django.test import Client, RequestFactory
from rest_framework import throttling as drf_throttling

from marketplace.auth_rate import _AUTH_SCOPE, _AuthRate

PASSWORD = "a long enough pass 42x"


def auth_limit() -> int:
    rate = django_settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"]["auth"]
    num_requests, _ = drf_throttling.ScopedRateThrottle().parse_rate(rate)
    return num_requests


def in_parallel(n: int, call) -> list:
    """call(i) in n threads released at once; each one's result (an exception is a result too)."""
    barrier = threading.Barrier(n)
    results: list = [None] * n

    def worker(i):
        try:
            barrier.wait(timeout=10)
            results[i] = call(i)
        except Exception as exc:  # noqa: BLE001 - reported by the assertions
            results[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


def test_the_auth_rate_holds_under_a_burst_of_parallel_requests():
    n = 60

    def one(_i):
        request = RequestFactory().post("/accounts/signup/", REMOTE_ADDR="203.0.113.9")
        return _AuthRate().allow_request(request, _AUTH_SCOPE)

    allowed = in_parallel(n, one)
    assert all(isinstance(a, bool) for a in allowed), allowed
    assert sum(allowed) == auth_limit(), f"{sum(allowed)} of {n} parallel requests passed a 20/min rate"
    # Another client has its own budget; the refused ones counted nothing.
    other = RequestFactory().post("/accounts/signup/", REMOTE_ADDR="203.0.113.10")
    assert _AuthRate().allow_request(other, _AUTH_SCOPE)


@pytest.mark.django_db(transaction=True)
def test_one_client_gets_no_more_than_the_rate_of_password_reset_emails_by_sending_them_at_once(mailoutbox):
    n = 40

    def one(i):
        return Client(REMOTE_ADDR="203.0.113.9").post("/accounts/password/reset/",
                                                      {"email": f"someone{i}@example.org"})

    answers = in_parallel(n, one)
    statuses = [getattr(r, "status_code", r) for r in answers]
    assert sorted(statuses, key=str) == sorted([302] * auth_limit() + [429] * (n - auth_limit()), key=str), statuses
    assert len(mailoutbox) == auth_limit(), f"{len(mailoutbox)} e-mails"
    refused = [r for r in answers if r.status_code == 429]
    assert all(0 < int(r["Retry-After"]) <= 60 for r in refused)


@pytest.mark.django_db(transaction=True)
def test_the_api_sign_up_holds_the_rate_under_parallel_requests_and_answers_429_with_retry_after(mailoutbox):
    n = 40

    def one(i):
        return Client(REMOTE_ADDR="203.0.113.11").post(
            "/api/v1/auth/register/", {"email": f"new{i}@example.org", "password": PASSWORD},
            content_type="application/json")

    answers = in_parallel(n, one)
    statuses = [getattr(r, "status_code", r) for r in answers]
    assert statuses.count(202) == auth_limit() and statuses.count(429) == n - auth_limit(), statuses
    assert len(mailoutbox) == auth_limit()
    refused = next(r for r in answers if r.status_code == 429)
    assert 0 < int(refused["Retry-After"]) <= 60 and "throttled" in refused.json()["detail"].lower()


def test_the_budget_opens_again_when_its_window_ends(monkeypatch):
    monkeypatch.setattr(drf_throttling.ScopedRateThrottle, "THROTTLE_RATES", {"auth": "2/s"})

    def ask():
        throttle = _AuthRate()
        return throttle.allow_request(RequestFactory().post("/", REMOTE_ADDR="203.0.113.12"), _AUTH_SCOPE), throttle

    assert ask()[0] and ask()[0]
    allowed, throttle = ask()
    assert not allowed and 0 < throttle.wait() <= 1
    time.sleep(1.1)
    assert ask()[0]


def test_no_rate_for_the_scope_lets_every_request_through(monkeypatch):
    monkeypatch.setattr(drf_throttling.ScopedRateThrottle, "THROTTLE_RATES", {"auth": None})
    request = RequestFactory().post("/", REMOTE_ADDR="203.0.113.13")
    assert all(_AuthRate().allow_request(request, _AUTH_SCOPE) for _ in range(auth_limit() + 5))
