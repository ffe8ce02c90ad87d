"""The `auth` rate on the pages' sign-up, log-in and password-reset POSTs and the admin's log-in: one budget per
client with the API's (marketplace/api/accounts.py `_AuthView`). Beside the entry points, not in one of them: the
pages (web) and the admin both call it, and neither imports the other."""
import math
from types import SimpleNamespace

from django.shortcuts import render

from core.api.throttling import ScopedRateThrottle


class _AuthRate(ScopedRateThrottle):
    """The API's sign-up and log-in rate (marketplace/api/accounts.py `_AuthView`: scope `auth`, AUTH_THROTTLE_RATE),
    in the same counter per client address (core.client_address; an IPv6 /64), a logged-in visitor's too: the pages
    and the API share one budget, so the requests cannot move between them."""

    def get_cache_key(self, request, view):
        return self.cache_format % {"scope": self.scope, "ident": self.get_ident(request)}


_AUTH_SCOPE = SimpleNamespace(throttle_scope="auth")


def auth_rate_refusal(request):
    """A 429 page (with Retry-After) when this client has used up the `auth` rate; else None, and the request is
    counted. Called first thing on the POSTs of the sign-up, log-in and password-reset pages: before any password
    is hashed or e-mail sent, and alike whatever address was typed (it says nothing about accounts)."""
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
