"""Nothing in the contract suite reaches the real Stripe; the owner's cases that pay use localstripe."""
import pytest

from tests.localstripe import WEBHOOK_SECRET


@pytest.fixture(autouse=True)
def _offline_stripe(settings):
    settings.STRIPE_API_BASE = "http://127.0.0.1:9"  # refused at once; tests that pay ask for `localstripe`
    settings.STRIPE_CONNECT_API_BASE = ""
    settings.STRIPE_MAX_NETWORK_RETRIES = 0
    settings.STRIPE_WEBHOOK_SECRET = WEBHOOK_SECRET
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
