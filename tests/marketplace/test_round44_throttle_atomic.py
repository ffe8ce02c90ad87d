"""core/api/throttling.py, where every API throttle comes from, counts each request atomically (found by review: it
offered DRF's ScopedRateThrottle, AnonRateThrottle and UserRateThrottle, whose SimpleRateThrottle reads the client's
history from the cache, checks it and writes it back, so requests that arrive together all read the same history and
all pass; the Anon and User ones were used nowhere, and the only user of the scoped one, the `auth` rate, replaced
its counting already: marketplace/auth_rate.py). A view that named core's ScopedRateThrottle got the racy count.

Real threads against the real Redis cache (the cache is cleared before every test: tests/conftest.py)."""
import threading

import pytest
from django.contrib.auth.models import AnonymousUser
from django.db import connection
from rest_framework import throttling as drf_throttling
from rest_framework.response import Response
from rest_framework.test import APIRequestFactory
from rest_framework.views import APIView

from core.api import throttling

SCOPE = "round44-test"
LIMIT = 5


@pytest.fixture(autouse=True)
def rate(monkeypatch):
    # DRF copies DEFAULT_THROTTLE_RATES into the class at import: override_settings cannot reach it.
    monkeypatch.setattr(drf_throttling.SimpleRateThrottle, "THROTTLE_RATES", {SCOPE: f"{LIMIT}/min", "auth": "20/min"})


class _View(APIView):
    authentication_classes: list = []
    permission_classes: list = []
    throttle_classes = [throttling.ScopedRateThrottle]
    throttle_scope = SCOPE

    def get(self, request):
        return Response({"ok": True})


def in_parallel(n: int, call) -> list:
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


def test_no_throttle_of_core_counts_with_drfs_read_modify_write():
    offered = [value for value in vars(throttling).values()
               if isinstance(value, type) and issubclass(value, drf_throttling.BaseThrottle)]
    assert offered == [throttling.ScopedRateThrottle]
    for throttle in offered:
        assert throttle.allow_request is not drf_throttling.SimpleRateThrottle.allow_request, throttle
    assert not hasattr(throttling, "AnonRateThrottle") and not hasattr(throttling, "UserRateThrottle")


def test_parallel_requests_of_one_client_get_no_more_than_the_rate():
    n = 40
    view = _View()

    def one(_i):
        request = APIRequestFactory().get("/", REMOTE_ADDR="203.0.113.44")
        request.user = AnonymousUser()
        return throttling.ScopedRateThrottle().allow_request(request, view)

    allowed = in_parallel(n, one)
    assert all(isinstance(a, bool) for a in allowed), allowed
    assert sum(allowed) == LIMIT, f"{sum(allowed)} of {n} parallel requests passed a {LIMIT}/min rate"
    # Another client has its own budget.
    other = APIRequestFactory().get("/", REMOTE_ADDR="203.0.113.45")
    other.user = AnonymousUser()
    assert throttling.ScopedRateThrottle().allow_request(other, view)


def test_parallel_requests_to_a_view_answer_429_with_retry_after_past_the_rate():
    n = 30
    answers = in_parallel(n, lambda _i: _View.as_view()(APIRequestFactory().get("/", REMOTE_ADDR="203.0.113.46")))
    statuses = [getattr(r, "status_code", r) for r in answers]
    assert statuses.count(200) == LIMIT and statuses.count(429) == n - LIMIT, statuses
    refused = next(r for r in answers if r.status_code == 429)
    assert 0 < int(refused["Retry-After"]) <= 60


def test_a_view_without_a_rate_for_its_scope_is_not_throttled():
    class Unrated(_View):
        throttle_scope = "no-such-scope-r44"

    with pytest.raises(Exception, match="No default throttle rate"):  # DRF's: a scope must have a rate
        Unrated.as_view()(APIRequestFactory().get("/", REMOTE_ADDR="203.0.113.47"))

    class Unscoped(_View):
        throttle_scope = None

    assert all(Unscoped.as_view()(APIRequestFactory().get("/", REMOTE_ADDR="203.0.113.47")).status_code == 200
               for _ in range(LIMIT + 3))
