"""The `auth` rate on sign-up, its confirmation, log-in and password reset: one budget per client for the API
(marketplace/api/accounts.py `_AuthView`), the pages and the admin's log-in. Beside the entry points, not in one of
them: the API, the pages (web) and the admin all use it, and none of them imports another.

Counted atomically: each request takes its place in the client's counter in one Redis step (core/login_throttle.py
`_take`, the script the log-in lock-out counts with) before anything is hashed or sent, and is refused when the last
place is taken. DRF's SimpleRateThrottle read the client's history from the cache, checked it and wrote it back, so
requests that arrived together all read the same history and all passed (60 of 60 at a 20/min rate; 40 parallel
password-reset POSTs all sent mail). A fixed window that opens with the client's first request (AUTH_THROTTLE_RATE:
at most N requests in it), as the lock-out's; a refused request counts nothing."""
import math
import time
from types import SimpleNamespace

from django.core.cache import cache
from django.shortcuts import render

from core.api.throttling import ScopedRateThrottle
from core.login_throttle import _take


class _AuthRate(ScopedRateThrottle):
    """The API's sign-up and log-in rate (scope `auth`, AUTH_THROTTLE_RATE), in the same counter per client
    address (core.client_address; an IPv6 /64), a logged-in visitor's too: the pages and the API share one budget,
    so the requests cannot move between them. DRF's interface (allow_request, wait), so the API's views name it in
    throttle_classes and answer 429 with Retry-After as for any DRF throttle."""

    # Not DRF's `throttle_auth_<ident>`: that key held a list of times, which the counter's INCR cannot take.
    cache_format = "auth-rate:%(scope)s:%(ident)s"

    def get_cache_key(self, request, view):
        return self.cache_format % {"scope": self.scope, "ident": self.get_ident(request)}

    def allow_request(self, request, view):
        self.scope = getattr(view, self.scope_attr, None)
        if not self.scope:
            return True
        self.rate = self.get_rate()
        self.num_requests, self.duration = self.parse_rate(self.rate)
        if self.rate is None:
            return True
        self.key = self.get_cache_key(request, view)
        now = time.time()
        n = _take(self.key, self.duration, self.num_requests)
        if n == 1:  # this request opened the window: when it ends is what the refused ones are told
            cache.set(f"{self.key}:opened", now, timeout=self.duration)
        if n <= self.num_requests:
            return True
        opened = cache.get(f"{self.key}:opened")  # None: its opener has not written it yet (a burst)
        left = self.duration if opened is None else opened + self.duration - now
        self._wait = float(min(self.duration, max(1, left)))  # a whole second at least: Retry-After is never 0
        return False

    def wait(self):
        """Seconds until the client's window ends (the answer's Retry-After)."""
        return getattr(self, "_wait", None)


_AUTH_SCOPE = SimpleNamespace(throttle_scope="auth")


def auth_rate_refusal(request):
    """A 429 page (with Retry-After) when this client has used up the `auth` rate; else None, and the request is
    counted. Called first thing on the POSTs of the sign-up, sign-up confirmation, log-in and password-reset pages:
    before any password is hashed or e-mail sent, and alike whatever address was typed (it says nothing about
    accounts)."""
    throttle = _AuthRate()
    if throttle.allow_request(request, _AUTH_SCOPE):
        return None
    retry_after = max(1, math.ceil(throttle.wait() or 1))
    wait = (f"{retry_after} second{'s' if retry_after != 1 else ''}" if retry_after < 120
            else f"{math.ceil(retry_after / 60)} minutes")
    response = render(request, "marketplace/too_many_requests.html", {"wait": wait, "back": request.path},
                      status=429)
    response["Retry-After"] = str(retry_after)
    return response
