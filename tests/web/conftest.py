"""Web page tests: Django's test client for every page, Playwright with Debian's Chromium for the stories."""
import os
from pathlib import Path

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


# ------------------------------------------------------- the browser (test_browser.py, test_csp.py, ...)

CHROMIUM = "/usr/bin/chromium"
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 60_000


@pytest.fixture(scope="session")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in requirements-dev.txt")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: scripts/ensure-services installs Debian's chromium (as root)")
    # Playwright's sync API keeps an event loop in this thread; the tests' own ORM calls are still synchronous.
    before = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_api.sync_playwright() as playwright:
            chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=LAUNCH_ARGS)
            yield chromium
            chromium.close()
    finally:
        if before is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = before


@pytest.fixture
def new_page(browser):
    contexts = []

    def make(**options):
        context = browser.new_context(**{"viewport": {"width": 1280, "height": 900}, **options})
        context.set_default_timeout(TIMEOUT_MS)
        contexts.append(context)
        page = context.new_page()
        page.errors = []
        page.on("pageerror", lambda exc: page.errors.append(str(exc)))
        return page

    yield make
    for context in contexts:
        context.close()
