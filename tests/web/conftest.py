"""Web page tests: Django's test client for every page, Playwright with Debian's Chromium for the stories."""
import pytest
from django.test import Client

from tests.factories import UserFactory

PASSWORD = "correct horse battery staple"


@pytest.fixture
def renter(db):
    return UserFactory(email="renter@example.com")


@pytest.fixture
def stranger(db):
    return UserFactory(email="stranger@example.com")


@pytest.fixture
def operator(db):
    return UserFactory(email="ops@example.com", is_staff=True, is_superuser=True)


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def web(renter):
    """A browser-like client logged in as `renter`."""
    return logged_in(renter)


@pytest.fixture
def csrf_web(renter):
    """Logged in as `renter`, with CSRF checks on (the test client turns them off by default)."""
    client = Client(enforce_csrf_checks=True)
    client.force_login(renter)
    return client


@pytest.fixture(autouse=True)
def no_real_stripe(settings):
    """Nothing here reaches the real Stripe: tests that need a Stripe use the `localstripe` fixture."""
    settings.STRIPE_API_BASE = "http://127.0.0.1:9"
    settings.STRIPE_MAX_NETWORK_RETRIES = 0
    settings.STRIPE_TIMEOUT_S = 5
    settings.STRIPE_PUBLISHABLE_KEY = "pk_test_local"


def fund(user, usd: int = 100) -> None:
    """Put money in the user's wallet as an operator's credit (the browser story tops up with a card instead)."""
    from billing.services.ledger import credit_grant

    credit_grant(user=user, amount_micros=usd * 1_000_000, reason="tests: starting balance")


@pytest.fixture
def funded_renter(renter):
    fund(renter)
    return renter
