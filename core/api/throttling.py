"""The API's throttle: DRF's ScopedRateThrottle (a view's `throttle_scope`, its rate in DEFAULT_THROTTLE_RATES),
counting by the client's address as core.client_address reads it (TRUSTED_PROXIES), not by DRF's NUM_PROXIES rule,
and counted atomically: every API throttle must come from here.

DRF's SimpleRateThrottle reads the client's history of request times from the cache, checks it and writes it back:
requests that arrive together all read the same history and all pass (27 or 28 of 30 parallel requests passed a 5/min
rate; found by review). Here each request takes its place in the client's counter in one Redis step
(core.login_throttle's counting script: INCR, the expiry set by the request that opens the window) and is refused
when the last place is taken, counting nothing. A fixed window that opens with the client's first request: at most
N requests in it. DRF's AnonRateThrottle and UserRateThrottle were offered here too, with DRF's count, and used
nowhere: removed."""
import time
from types import SimpleNamespace

from django.core.cache import cache
from django.http import HttpRequest
from rest_framework import throttling
from rest_framework.request import Request
from rest_framework.views import APIView

from core.client_address import client_ip, throttle_ident
from core.login_throttle import _take


class ClientAddressMixin:
    def get_ident(self, request: Request) -> str:
        return throttle_ident(client_ip(request))


class ScopedRateThrottle(ClientAddressMixin, throttling.ScopedRateThrottle):
    """DRF's interface (allow_request, wait: the views answer 429 with Retry-After), its key (the user for a
    logged-in request, else the client's address), and an atomic count."""

    # Not DRF's `throttle_<scope>_<ident>`: that key held a list of times, which the counter's INCR cannot take.
    cache_format = "throttle-rate:%(scope)s:%(ident)s"

    def allow_request(self, request: Request, view: APIView) -> bool:
        self.scope = getattr(view, self.scope_attr, None)
        if not self.scope:
            return True
        self.rate = self.get_rate()  # DRF's ImproperlyConfigured for a scope without a rate
        self.num_requests, self.duration = self.parse_rate(self.rate)
        limit, window = self.num_requests, self.duration
        if limit is None or window is None:  # the scope's rate is None: not throttled
            return True
        self.key = self.get_cache_key(request, view)
        if self.key is None:
            return True
        now = time.time()
        n = _take(self.key, window, limit)
        if n == 1:  # this request opened the window: when it ends is what the refused ones are told
            cache.set(f"{self.key}:opened", now, timeout=window)
        if n <= limit:
            return True
        opened = cache.get(f"{self.key}:opened")  # None: its opener has not written it yet (a burst)
        left = window if opened is None else opened + window - now
        self._wait = float(min(window, max(1, left)))  # a whole second at least: Retry-After is never 0
        return False

    def wait(self) -> float | None:
        """Seconds until the client's window ends (the answer's Retry-After)."""
        return getattr(self, "_wait", None)


def scoped_rate_wait(request: HttpRequest | Request, scope: str) -> float | None:
    """For a page: count the request against `scope`'s rate, in the same counter as the API's views with that
    `throttle_scope` (the user's, else the client address's), so the two share one budget. None when it is allowed;
    else the seconds until the window ends (the page's Retry-After)."""
    throttle = ScopedRateThrottle()
    if throttle.allow_request(request, SimpleNamespace(throttle_scope=scope)):  # type: ignore[arg-type]
        return None
    return throttle.wait() or 1.0
