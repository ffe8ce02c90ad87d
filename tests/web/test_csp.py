"""The pages under the production Content-Security-Policy, in a real browser: headless Chromium (Playwright) loads
the main pages as a visitor, a renter, a provider and an operator, and Stripe Elements on the balance page (with
localstripe's Stripe.js standing in for Stripe's), and none of them may log a CSP violation.
"""
import re
from datetime import timedelta

import pytest
from django.contrib import admin
from django.urls import reverse
from django.utils import timezone

from billing.services.ledger import credit_grant
from config.settings.csp import content_security_policy
from marketplace.models import NodeState, Verdict
from provisioning.models import Job, NodeEvent, VerificationRun
from tests.factories import UserFactory, make_listed_node, make_node
from tests.marketplace.renting_helpers import add_key, book, run
from tests.web.test_browser import log_in
from tests.web.test_provider_pages import FIGURES, FINDINGS

pytestmark = pytest.mark.slow

# Every violation the page's documents see, as the browser reports it to the page (init scripts run outside CSP).
RECORD_VIOLATIONS = """
window.__cspViolations = [];
document.addEventListener("securitypolicyviolation", (e) => window.__cspViolations.push(
  `${e.effectiveDirective} blocked ${e.blockedURI || "inline"} in ${e.sourceFile || e.documentURI}:${e.lineNumber}`));
"""


class CspWatch:
    """A page whose CSP violations (console messages and violation events, in every frame) are collected on every
    visit: call `collect()` after acting on a page, before leaving it."""

    def __init__(self, page):
        self.page = page
        self.found = []
        page.add_init_script(RECORD_VIOLATIONS)
        page.on("console", self._console)

    def _console(self, message):
        if "Content Security Policy" in message.text or "Content-Security-Policy" in message.text:
            self.found.append(f"{self.page.url}: {message.text}")

    def collect(self) -> list[str]:
        for frame in self.page.frames:
            try:
                events = frame.evaluate("window.__cspViolations.splice(0)")
            except Exception:  # noqa: S112 (a frame that went away, or not ours to script)
                continue
            self.found += [f"{self.page.url}: {event}" for event in events]
        return self.found

    def visit(self, url: str, *, status: int = 200) -> None:
        self.collect()  # what the page before left
        response = self.page.goto(url)
        assert response.status == status, f"{url}: {response.status}"
        policy = response.headers.get("content-security-policy", "")
        assert "default-src 'self'" in policy and "unsafe-inline" not in policy, f"{url}: {policy!r}"
        # goto waited for the load event, so every script, style and image of the page was fetched (or blocked);
        # a 100 ms timer lets the violation events queued meanwhile reach the page's listener. What a page loads
        # later (Stripe Elements' frames) is waited for by the test that makes it load, with settle().
        self.page.evaluate("new Promise((done) => setTimeout(done, 100))")
        self.collect()

    def settle(self) -> None:
        """Until the network has been idle for half a second (or 5 s have passed)."""
        try:
            self.page.wait_for_load_state("networkidle", timeout=5_000)
        except Exception:  # noqa: S110 (a page that polls may never be idle for long: what loaded is enough)
            pass

    def assert_clean(self, where: str = "") -> None:
        found = self.collect()
        assert not found, f"CSP violations {where}:\n" + "\n".join(found)
        assert not self.page.errors, f"script errors {where}: {self.page.errors}"


@pytest.fixture
def strict_csp(settings):
    """The production policy (config/settings/csp.py) with its defaults, whatever the environment says."""
    settings.STRIPE_JS_URL = "https://js.stripe.com/v3/"
    settings.CONTENT_SECURITY_POLICY = content_security_policy()
    assert "csp.middleware.CSPMiddleware" in settings.MIDDLEWARE
    return settings.CONTENT_SECURITY_POLICY


@pytest.fixture
def watch(new_page, strict_csp):
    def make(**options):
        return CspWatch(new_page(**options))
    return make


@pytest.fixture
def marketplace(transactional_db):
    """A renter with a running instance and money, a provider with a listed node and a rejected one (findings, a
    chart), a stuck job and a critical event, and an operator."""
    provider = UserFactory(email="provider@example.com")
    renter = UserFactory(email="renter@example.com")
    operator = UserFactory(email="ops@example.com", is_staff=True, is_superuser=True)
    listed = make_listed_node(provider, name="fra-a100", gpu_model="a100-80gb-sxm", gpu_count=4)
    make_listed_node(provider, name="ams-a6000", gpu_model="rtx-a6000", gpu_count=8, country="NL")
    rejected = make_node(provider, name="fake-a100", gpu_model="a100-80gb-sxm", gpu_count=2,
                         state=NodeState.REJECTED, verdict=Verdict.REJECTED)
    VerificationRun.objects.create(node=rejected, verdict="rejected", findings=FINDINGS, figures=FIGURES, score=0)
    Job.objects.create(kind="node_verify", node=rejected, status="running", step="benchmarking GPU 0",
                       deadline=timezone.now() - timedelta(minutes=5))
    NodeEvent.objects.create(node=rejected, level="critical", kind="host_key_changed", message="key changed")
    credit_grant(user=renter, amount_micros=100_000_000, reason="tests: starting balance")
    add_key(renter, name="laptop")
    instance = run(book(renter, listed, num_gpus=2))
    return {"provider": provider, "renter": renter, "operator": operator, "listed": listed, "rejected": rejected,
            "instance": instance}


def test_public_pages_and_the_api_docs(live_server, watch, marketplace):
    w = watch()
    base = live_server.url
    for url in ("/", "/offers/", "/offers/?gpu_model=a100-80gb-sxm&ordering=-score", "/gpus/",
                "/gpus/?models=a100-80gb-sxm&models=rtx-a6000", "/accounts/login/", "/accounts/signup/"):
        w.visit(base + url)
    w.visit(base + "/no-such-page/", status=404)
    w.visit(base + "/offers/?min_gpus=two", status=400)  # a form's errors
    w.visit(base + "/api/docs/")
    w.page.locator(".swagger-ui .info").wait_for()  # Swagger UI started from its script file and drew the schema
    w.page.locator(".opblock-tag", has_text=re.compile("offers", re.I)).first.wait_for()
    w.assert_clean("on the public pages")


def test_renter_and_provider_pages(live_server, watch, marketplace):
    base = live_server.url
    renter = watch()
    log_in(renter.page, base, "renter@example.com")
    instance = marketplace["instance"]
    for url in (f"/offers/{marketplace['listed'].pk}/rent/", "/instances/", f"/instances/{instance.pk}/",
                "/account/ssh-keys/", "/account/api-keys/", "/account/balance/", "/account/usage/",
                "/account/statements/"):
        renter.visit(base + url)
    # The instance page's confirmation (details/summary) and its live part, updated by site.js.
    renter.visit(f"{base}/instances/{instance.pk}/")
    renter.page.locator("summary", has_text="Destroy").click()
    renter.page.get_by_role("button", name="Destroy instance").wait_for()
    renter.page.wait_for_timeout(1_500)
    renter.assert_clean("on the renter's pages")

    provider = watch()
    log_in(provider.page, base, "provider@example.com")
    for url in ("/nodes/", "/nodes/new/", f"/nodes/{marketplace['listed'].pk}/",
                f"/nodes/{marketplace['rejected'].pk}/", "/earnings/", "/payouts/"):
        provider.visit(base + url)
    provider.assert_clean("on the provider's pages")


def test_balance_with_stripe_elements(live_server, watch, marketplace, localstripe, settings):
    """A real-looking publishable key: the page loads Stripe.js (here localstripe's, at its own origin, which the
    policy then allows in Stripe's place) and Elements' card field; saving a card goes through to the server."""
    settings.STRIPE_PUBLISHABLE_KEY = "pk_test_" + "51Habcdefghijklmnopqrstu"
    settings.STRIPE_JS_URL = f"{localstripe.url}/js.stripe.com/v3/"
    settings.CONTENT_SECURITY_POLICY = content_security_policy(stripe_js_url=settings.STRIPE_JS_URL)
    w = watch()
    base = live_server.url
    log_in(w.page, base, "renter@example.com")
    w.visit(f"{base}/account/balance/")
    card = w.page.locator("#card-element")
    for field, value in (("number", "4242424242424242"), ("exp_month", "12"), ("exp_year", "34"),
                         ("cvc", "123"), ("postal_code", "10001")):
        card.locator(f"input[placeholder={field}]").fill(value)
    w.page.get_by_role("button", name="Save card").click()
    w.page.get_by_text("Card Visa •••• 4242 saved.").wait_for()
    w.settle()
    w.assert_clean("on the balance page with Stripe Elements")


def test_balance_refuses_a_script_from_anywhere_else(live_server, watch, marketplace, settings):
    """The check can fail: Stripe.js from an origin the policy does not name is blocked and reported."""
    settings.STRIPE_PUBLISHABLE_KEY = "pk_test_" + "51Habcdefghijklmnopqrstu"
    settings.STRIPE_JS_URL = "http://127.0.0.1:9/js.stripe.com/v3/"  # the policy still names only Stripe
    w = watch()
    log_in(w.page, live_server.url, "renter@example.com")
    w.visit(f"{live_server.url}/account/balance/")
    found = w.collect()
    assert any("script-src" in v and "127.0.0.1:9" in v for v in found), found


def _admin_urls(marketplace) -> list[str]:
    urls = [reverse("admin:index")]
    for model in admin.site._registry:
        info = (model._meta.app_label, model._meta.model_name)
        urls.append(reverse("admin:{}_{}_changelist".format(*info)))
        first = model._default_manager.order_by("pk").first()
        if first is not None:
            urls.append(reverse("admin:{}_{}_change".format(*info), args=[first.pk]))
    urls += [reverse("admin:marketplace_user_add"), reverse("admin:marketplace_node_change",
                                                            args=[marketplace["rejected"].pk])]
    return urls


def test_admin_pages(live_server, watch, marketplace):
    w = watch()
    base = live_server.url
    w.page.goto(f"{base}/admin/login/")
    w.page.locator("#id_username").fill("ops@example.com")
    w.page.locator("#id_password").fill("correct horse battery staple")
    w.page.get_by_role("button", name="Log in").click()
    w.page.wait_for_url(re.compile(r"/admin/$"))
    for url in _admin_urls(marketplace):
        w.visit(base + url)
    w.assert_clean("in the admin")
