"""Every page of the site, taken from the URL conf so that a new page cannot be forgotten (issue 16): in headless
Chromium under the production CSP, as the visitor, renter, provider or operator who sees it, each page

- scrolls no sideways on a 390 x 844 phone,
- shows no currency amount with more than two decimals (nor "$-5.00"),
- is clean for axe-core (WCAG 2.x A and AA rules), with the axe script from the axe-playwright-python package
  (its axe.min.js, put into the page by Playwright: no CDN, nothing added to the site).

A route of the web URL conf is a PAGE (walked below), an ACTION (POST only: a GET must answer 405, checked) or
EXCLUDED with the reason; test_every_route_is_walked_or_excluded fails on any other, so a new page is walked or
excluded on purpose. The API (/api/, /compat/, /healthz) answers JSON, not pages, and Django's admin draws its
own pages (tests/web/test_csp.py walks every model's): only the operators' dashboard (the admin's index, ours) and
our admin action form are walked here.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from axe_playwright_python.base import AXE_SCRIPT
from django.urls import URLPattern, URLResolver, get_resolver, reverse

from tests.web.conftest import PASSWORD, logged_in
from tests.web.test_browser import log_in
from tests.web.test_csp import marketplace  # noqa: F401 (a fixture)
from tests.web.test_page_layout import FINE_AMOUNTS, NO_SIDEWAYS_SCROLL, odd_money, wide_offers  # noqa: F401

# Routes under these answer JSON or are Django's admin (see the docstring).
NOT_PAGES = ("api/", "compat/", "healthz", "metrics", "admin/")


@dataclass(frozen=True)
class Page:
    who: str  # "visitor", "renter", "provider" or "operator"
    path: Callable[[dict], str]
    status: int = 200


PAGES: dict[str, list[Page]] = {
    "home": [Page("visitor", lambda d: "/"), Page("renter", lambda d: "/")],
    "login": [Page("visitor", lambda d: "/accounts/login/")],
    "signup": [Page("visitor", lambda d: "/accounts/signup/")],
    "signup-confirm": [Page("visitor", lambda d: "/accounts/confirm/not-a-real-token/")],  # GET shows a button
    "ssh-keys": [Page("renter", lambda d: "/account/ssh-keys/")],
    "api-keys": [Page("renter", lambda d: "/account/api-keys/")],
    "offers": [Page("visitor", lambda d: "/offers/"), Page("renter", lambda d: "/offers/?ordering=-score"),
               Page("visitor", lambda d: "/offers/?min_gpus=two", status=400)],  # a filter's error
    "rent": [Page("renter", lambda d: f"/offers/{d['listed'].pk}/rent/"),
             Page("renter", lambda d: f"/offers/{d['mig'].pk}/rent/")],  # MIG slices only
    "gpu-compare": [Page("visitor", lambda d: "/gpus/"),
                    Page("visitor", lambda d: "/gpus/?models=a100-80gb-sxm&models=rtx-a6000&models=rtx-4090")],
    "instances": [Page("renter", lambda d: "/instances/")],
    "instance": [Page("renter", lambda d: f"/instances/{d['instance'].pk}/")],
    "nodes": [Page("provider", lambda d: "/nodes/")],
    "node-register": [Page("provider", lambda d: "/nodes/new/")],
    "node": [Page("provider", lambda d: f"/nodes/{d['listed'].pk}/"),
             Page("provider", lambda d: f"/nodes/{d['rejected'].pk}/"),
             Page("provider", lambda d: f"/nodes/{d['mig'].pk}/")],  # its MIG slices and layout form
    "web-balance": [Page("renter", lambda d: "/account/balance/")],
    "web-usage": [Page("renter", lambda d: "/account/usage/")],
    "web-statements": [Page("renter", lambda d: "/account/statements/")],
    "web-statement": [Page("renter", lambda d: f"/account/statements/{d['month']}/")],
    "web-earnings": [Page("provider", lambda d: "/earnings/")],
    "web-payouts": [Page("provider", lambda d: "/payouts/")],
    "volumes": [Page("renter", lambda d: "/volumes/")],
    # Accounts: passwords and two-factor log-in
    "password-reset": [Page("visitor", lambda d: "/accounts/password/reset/")],
    "password-reset-done": [Page("visitor", lambda d: "/accounts/password/reset/sent/")],
    "password-reset-confirm": [Page("visitor", lambda d: "/accounts/password/reset/MQ/not-a-token/")],  # says so
    "password-reset-complete": [Page("visitor", lambda d: "/accounts/password/reset/done/")],
    "email-verify": [Page("visitor", lambda d: "/accounts/verify/MQ/not-a-token/", status=400)],  # says so
    "password-change": [Page("renter", lambda d: "/account/password/")],
    "account-security": [Page("renter", lambda d: "/account/security/")],
    "two-factor-enable": [Page("renter", lambda d: "/account/two-factor/enable/")],
    "two-factor-disable": [Page("renter", lambda d: "/account/two-factor/disable/")],
    # Notifications
    "notifications": [Page("renter", lambda d: "/account/notifications/")],
    "notification-settings": [Page("renter", lambda d: "/account/notifications/settings/")],
    "notification-endpoint": [Page("renter", lambda d: f"/account/notifications/webhooks/{d['endpoint'].pk}/")],
    "notification-unsubscribe": [Page("visitor", lambda d: "/account/notifications/unsubscribe/not-a-token/",
                                      status=400)],  # a notification e-mail's link: says it is not a valid one
    # Django's admin, ours: the operators' dashboard.
    "admin:index": [Page("operator", lambda d: "/admin/")],
    # The site's error pages (tests/web/error_urls.py raises each one).
    "error-404": [Page("visitor", lambda d: "/no-such-page/", status=404),
                  Page("renter", lambda d: "/instances/999999/", status=404)],
    "error-400": [Page("visitor", lambda d: "/test-errors/400/", status=400)],
    "error-403": [Page("renter", lambda d: "/test-errors/403/", status=403)],
    "error-500": [Page("visitor", lambda d: "/test-errors/500/", status=500)],
}

# POST only: a GET answers 405 (test_actions_are_not_pages), the page they come from is walked.
ACTIONS = {
    "logout": "the account menu's Log out button",
    "ssh-key-delete": "the SSH keys page's Delete", "api-key-revoke": "the API keys page's Revoke",
    "instance-verb": "an instance page's Stop / Start / Destroy",
    "node-verify": "a server page's Verify now", "node-settings": "a server page's settings form",
    "node-mig": "a server page's MIG layout form",
    "node-retire": "a server page's Retire",
    "web-top-up": "the balance page's Top up", "web-card-add": "the balance page's Save card",
    "web-card-remove": "the balance page's Remove card",
    "volume-delete": "the volumes page's Delete",
    "two-factor-confirm": "the two-factor enable page's code form, shown after the password",
    "two-factor-recovery": "the security page's new recovery codes",
    "email-verification-resend": "the rent, server registration and security pages' Send the link again",
    "notification-read": "the notifications page's Mark read",
    "notifications-read-all": "the notifications page's Mark all read",
    "notification-endpoint-test": "a webhook page's Send a test event",
    "notification-endpoint-toggle": "a webhook page's Pause / Resume",
    "notification-endpoint-delete": "a webhook page's Delete",
}
EXCLUDED = {
    "instance-live": "a polled fragment of the instance page (no <html>), checked inside that page",
    "node-live": "a polled fragment of the server page, checked inside that page",
    "web-balance-live": "a polled fragment of the balance page, checked inside that page",
    "api-docs": "Swagger UI's own markup (drf-spectacular's static files); test_csp checks it loads under the CSP",
    "schema": "the OpenAPI document (YAML), not a page",
    "login-code": "the log-in's second step, only with a password just given (tests/web/test_two_factor_pages.py)",
}


def web_routes() -> dict[str, str]:
    """{URL name: route} of every named route outside NOT_PAGES, from the URL conf as Django resolves it."""
    found: dict[str, str] = {}

    def walk(patterns, prefix: str, namespace: str | None):
        for p in patterns:
            if isinstance(p, URLResolver):
                walk(p.url_patterns, prefix + str(p.pattern), p.namespace or namespace)
            elif isinstance(p, URLPattern) and p.name:
                route = prefix + str(p.pattern)
                name = f"{namespace}:{p.name}" if namespace else p.name
                if name == "admin:index" or not route.startswith(NOT_PAGES):
                    found[name] = route
    walk(get_resolver("config.urls").url_patterns, "", None)
    found.update({name: name for name in PAGES if name.startswith("error-")})
    return found


def test_every_route_is_walked_or_excluded():
    routes = web_routes()
    unknown = sorted(set(routes) - set(PAGES) - set(ACTIONS) - set(EXCLUDED))
    assert not unknown, f"new pages: add them to PAGES (or ACTIONS / EXCLUDED, saying why): {unknown}"
    gone = sorted((set(PAGES) | set(ACTIONS) | set(EXCLUDED)) - set(routes) - {"api-docs", "schema"})
    assert not gone, f"listed here but no longer routed: {gone}"
    assert len(EXCLUDED) <= 7  # small, each with its reason


@pytest.mark.django_db
def test_actions_are_not_pages(renter):
    client = logged_in(renter)
    for name in ACTIONS:
        route = web_routes()[name]
        path = "/" + re.sub(r"<(?:\w+:)?(\w+)>", lambda m: "stop" if m.group(1) == "verb" else "1", route)
        assert client.get(path).status_code == 405, (name, path)


# ------------------------------------------------------------------------------------- in a browser

@pytest.fixture
def site(odd_money, settings):  # noqa: F811 (the fixture imported above)
    """The production CSP, the error-raising routes, and data on every page (test_page_layout's odd money)."""
    from django.utils import timezone

    from config.settings.csp import content_security_policy

    settings.CONTENT_SECURITY_POLICY = content_security_policy()
    settings.ROOT_URLCONF = "tests.web.error_urls"
    from marketplace.services.volumes import volume_create
    from notifications.models import Kind
    from notifications.services.notify import notify
    from notifications.services.webhooks import endpoint_create

    renter = odd_money["renter"]
    endpoint, _secret = endpoint_create(user=renter, url="http://127.0.0.1:9/hooks", description="my receiver")
    notify(user=renter, kind=Kind.CREDIT_POSTED, payload={"amount": "12.345678", "message": "A credit."},
           dedupe_key="pages:credit")
    volume_create(owner=renter, node_id=odd_money["listed"].pk, size_gb=10, label="datasets")
    return {**odd_money, "month": timezone.now().strftime("%Y-%m"), "endpoint": endpoint}


EMAILS = {"renter": "renter@example.com", "provider": "provider@example.com", "operator": "ops@example.com"}


def _pages(data) -> dict[str, list[tuple[str, str, int]]]:
    """(name, path, status) by who opens them."""
    by_who: dict[str, list[tuple[str, str, int]]] = {}
    for name, pages in PAGES.items():
        for page in pages:
            by_who.setdefault(page.who, []).append((name, page.path(data), page.status))
    return by_who


def _signed_in(new_page, base: str, who: str, **options):
    """A page logged in as `who`, its context with axe in every document it loads (_axe)."""
    page = new_page(**options)
    page.context.add_init_script(AXE_SCRIPT)
    if who == "operator":
        page.goto(f"{base}/admin/login/")
        page.locator("#id_username").fill(EMAILS[who])
        page.locator("#id_password").fill("correct horse battery staple")
        page.get_by_role("button", name="Log in").click()
        page.wait_for_url(re.compile(r"/admin/$"))
    elif who != "visitor":
        log_in(page, base, EMAILS[who])
    return page


def _visit(page, url: str, status: int) -> None:
    """The page once loaded (goto waits for its load event): the site draws every page on the server, and its
    scripts (site.js) act on DOMContentLoaded, before the load; a live region first polls 2 s later. Waiting for
    the network to be idle cost half a second a page."""
    response = page.goto(url)
    assert response.status == status, f"{url}: {response.status}"


# Rules axe leaves to a person (and one that needs the whole site): not run.
AXE_OPTIONS = {"runOnly": {"type": "tag", "values": ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa", "wcag22aa",
                                                      "best-practice"]},
               "resultTypes": ["violations"]}


def _axe(page, context: str | None = None) -> list[str]:
    """axe's violations on the page (or in `context`, a selector). The script is put into the page only if the
    page's context did not already put it into every document (_signed_in): sent through Playwright with every
    page, its 570 kB cost the walks 3 s each."""
    if not page.evaluate("typeof axe !== 'undefined'"):
        page.evaluate(AXE_SCRIPT)
    results = page.evaluate("([context, options]) => axe.run(context === null ? document : context, options)",
                            [context, AXE_OPTIONS])
    return [f"{v['id']} ({v['impact']}): {v['help']} at {', '.join(str(n['target']) for n in v['nodes'][:3])}"
            for v in results["violations"]]


def _walk_with_axe(page, base: str, who: str, pages, found: list[str], *, phone: bool) -> None:
    for _name, path, status in pages:
        _visit(page, base + path, status)
        found += [f"{who} {path}: {v}" for v in _axe(page)]
    if who == "renter":  # the menus open, and a confirmation: what axe sees then too
        _visit(page, f"{base}/account/ssh-keys/", 200)
        if phone:
            page.get_by_role("button", name="Menu").click()
        page.locator("summary", has_text="Account").click()
        delete = page.locator("summary", has_text="Delete").first
        shown = delete.bounding_box()
        delete.click()
        if phone:  # a key's Delete and its confirmation are within the phone's width
            sure = page.get_by_role("button", name="Yes, delete the key").bounding_box()
            width = page.viewport_size["width"]
            found += [f"{who} /account/ssh-keys/: {what} at {box}" for what, box in (("Delete", shown),
                      ("its confirmation", sure)) if not (box and box["x"] >= 0 and box["x"] + box["width"] <= width)]
        found += [f"{who} /account/ssh-keys/ (menu and confirmation open): {v}" for v in _axe(page)]
        # The two-factor secret (its QR code) and code form: only in the answer to the password, so not a GET.
        _visit(page, f"{base}/account/two-factor/enable/", 200)
        page.get_by_label("Password").fill(PASSWORD)
        page.get_by_role("button", name="Show the secret").click()
        page.locator("#totp-secret").wait_for()
        found += [f"{who} the two-factor secret: {v}" for v in _axe(page)]
        if not page.evaluate(NO_SIDEWAYS_SCROLL):
            found.append(f"{who} the two-factor secret: scrolls sideways")
        page.get_by_label("Code from the app").fill("000000")
        page.get_by_role("button", name="Confirm and turn on").click()
        page.get_by_text("That code is not right").wait_for()
        found += [f"{who} the two-factor code, wrong: {v}" for v in _axe(page)]


def _money_past_cents(page, path: str) -> tuple[str, list[str]]:
    """The page's text, and its amounts shown past cents or with the sign after the "$" (prices per unit are
    exact, test_page_layout.FINE_AMOUNTS)."""
    text = page.locator("body").inner_text()
    return text, ([f"{path}: {m}" for m in page.evaluate(FINE_AMOUNTS)]
                  + [f"{path}: {m}" for m in re.findall(r"\$\s?-\d[\d,.]*", text)])  # "$-5.00": the sign goes first


@pytest.mark.slow
def test_axe_finds_nothing_on_any_page_at_1366_and_money_reads_in_cents(live_server, new_page, site):
    """Every page at 1366 px: axe clean, and (with odd amounts of six decimals everywhere) no amount past cents while
    prices per unit show every decimal, as charged and filtered on."""
    base, found, fine, seen = live_server.url, [], [], 0
    for who, pages in _pages(site).items():
        page = _signed_in(new_page, base, who, viewport={"width": 1366, "height": 900})
        for _name, path, status in pages:
            _visit(page, base + path, status)
            text, past_cents = _money_past_cents(page, path)
            fine += past_cents
            seen += text.count("$")
            if path.split("?")[0] == "/offers/" and status == 200:  # prices per GPU-hour exact, never in cents
                assert "$1.234567" in text and "$1,234.567891" in text and "$1.23\t" not in text, (who, path)
            found += [f"{who} {path}: {v}" for v in _axe(page)]
        _walk_with_axe(page, base, who, [], found, phone=False)  # the renter's open menus
    assert seen > 40 and not fine, fine
    assert not found, "\n".join(found)


@pytest.mark.slow
def test_every_page_on_a_phone_fits_shows_money_in_cents_and_passes_axe(live_server, new_page, site):
    """One walk at 390 px as a phone: no sideways scroll, no amount past cents (prices per unit are exact), axe
    clean (menus open too)."""
    base, wide, fine, found, seen = live_server.url, [], [], [], 0
    for who, pages in _pages(site).items():
        page = _signed_in(new_page, base, who, viewport={"width": 390, "height": 844}, is_mobile=True,
                          has_touch=True)
        for _name, path, status in pages:
            _visit(page, base + path, status)
            seen += 1
            if not page.evaluate(NO_SIDEWAYS_SCROLL):
                culprits = page.evaluate(
                    "[...document.querySelectorAll('body *')].filter(el => el.getBoundingClientRect().right > "
                    "window.innerWidth + 1).slice(-3).map(el => el.tagName + '.' + el.className)")
                wide.append(f"{who} {path}: {page.evaluate('document.scrollingElement.scrollWidth')} px {culprits}")
            fine += _money_past_cents(page, path)[1]
            found += [f"{who} {path}: {v}" for v in _axe(page)]
        _walk_with_axe(page, base, who, [], found, phone=True)  # the renter's open menus, Delete in view
        assert not page.errors, (who, page.errors)
    assert seen == sum(len(p) for p in PAGES.values())
    assert not wide and not fine and not found, (wide, fine, "\n".join(found))


@pytest.mark.slow
def test_axe_would_tell(live_server, new_page, site):
    """The check can fail: a page with an image without text and an unlabelled field is reported."""
    page = new_page()
    _visit(page, live_server.url + "/offers/", 200)
    page.evaluate("document.querySelector('main').insertAdjacentHTML('beforeend', "
                  "'<img src=\"/static/marketplace/favicon.svg\"><input type=\"text\">')")
    found = " ".join(_axe(page))
    assert "image-alt" in found and "label" in found, found


@pytest.mark.slow
def test_the_admin_action_form_is_clean(live_server, new_page, site):
    """Ours inside the admin: the form an operator fills to credit wallets (billing/admin.py)."""
    from billing.models import Account, AccountKind

    wallet = Account.objects.filter(kind=AccountKind.CUSTOMER_WALLET).first()
    page = _signed_in(new_page, live_server.url, "operator")
    _visit(page, live_server.url + reverse("admin:billing_account_changelist") + "?kind__exact=customer_wallet", 200)
    page.locator(f"input[name=_selected_action][value='{wallet.pk}']").check()
    page.locator("select[name=action]").select_option("credit")
    page.locator("button[name=index]").first.click()  # the admin's "Go"
    page.get_by_role("heading", name="Credit wallets").wait_for()  # one heading (strict: not two)
    assert not _axe(page, context="#content")  # ours; the breadcrumbs above it are Django's
