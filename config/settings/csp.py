"""The Content-Security-Policy of every page (django-csp's CSPMiddleware sends it).

The pages load nothing from other sites but Stripe.js (the balance page, with a real publishable key), and keep
no inline script or style: scripts and styles are static files. So the policy is strict: our own origin, plus
what Stripe documents for Stripe.js and Elements (its script, its iframes, its API).
"""
from urllib.parse import urlsplit

from csp.constants import NONE, SELF

STRIPE_JS_URL = "https://js.stripe.com/v3/"
# What Stripe.js and Elements need (Stripe's "Content Security Policy" guide).
_STRIPE_SCRIPTS = ["https://js.stripe.com", "https://*.js.stripe.com"]
_STRIPE_FRAMES = ["https://js.stripe.com", "https://*.js.stripe.com", "https://hooks.stripe.com"]
_STRIPE_API = ["https://api.stripe.com"]


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" if parts.scheme and parts.netloc else ""


def content_security_policy(*, stripe_js_url: str = STRIPE_JS_URL, report_uri: str = "") -> dict:
    """django-csp's CONTENT_SECURITY_POLICY for these pages.

    `stripe_js_url` is where the balance page loads Stripe.js from; another origin than Stripe's (localstripe's
    stand-in, in tests and demos) is allowed to serve the script, frames and API calls in Stripe's place.
    """
    scripts, frames, api = list(_STRIPE_SCRIPTS), list(_STRIPE_FRAMES), list(_STRIPE_API)
    other = _origin(stripe_js_url)
    if other and other != "https://js.stripe.com":
        scripts.append(other)
        frames.append(other)
        api.append(other)
    directives = {
        "default-src": [SELF],
        "script-src": [SELF, *scripts],
        "style-src": [SELF],
        "img-src": [SELF, "data:"],  # the API docs' stylesheet draws its icons as data: URLs
        "font-src": [SELF],
        "connect-src": [SELF, *api],
        "frame-src": frames,
        "object-src": [NONE],
        "base-uri": [NONE],
        "form-action": [SELF],
        "frame-ancestors": [NONE],
    }
    if report_uri:
        directives["report-uri"] = [report_uri]
    return {"DIRECTIVES": directives}
