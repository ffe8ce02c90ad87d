"""The navigation by role (marketplace/web/nav.py, issue 16): a visitor, a renter, a provider and an operator each
see their own links; a compact "Menu" on a phone that works under the site's CSP; one line at 1366 px."""
import re

import pytest
from django.test import Client

from marketplace.web import nav
from tests.factories import UserFactory, make_node
from tests.web.conftest import logged_in
from tests.web.test_browser import shot, shots_dir  # noqa: F401 (fixtures: $WEB_SCREENSHOTS_DIR)

RENTER = {"/offers/", "/gpus/", "/instances/", "/account/balance/", "/account/usage/", "/account/statements/",
          "/account/ssh-keys/", "/account/api-keys/", "/volumes/", "/account/security/", "/account/notifications/"}
PROVIDER = {"/nodes/", "/earnings/", "/payouts/"}


def _nav_links(client, url="/") -> set[str]:
    page = client.get(url).content.decode()
    menu = page.split('<nav aria-label="Main"', 1)[1].split("</nav>", 1)[0]
    return set(re.findall(r'href="([^"]+)"', menu)) - {"/"}


@pytest.mark.django_db
def test_a_visitor_sees_the_offers_and_how_to_sign_in(client):
    assert _nav_links(client) == {"/offers/", "/gpus/", "/accounts/login/", "/accounts/signup/"}


@pytest.mark.django_db
def test_a_renter_sees_renting_money_and_account_and_one_way_to_provide(web):
    links = _nav_links(web)
    assert links == RENTER | {"/nodes/new/"}  # "Provide GPUs", not the provider's pages
    page = web.get("/").content.decode()
    assert ">Provide GPUs</a>" in page and "Operators" not in page and "Log out" in page


@pytest.mark.django_db
def test_a_provider_sees_their_pages_once_they_have_a_server_or_open_one(web, renter):
    assert _nav_links(web, "/nodes/") == RENTER | PROVIDER  # they chose to provide: on a provider page
    make_node(renter, name="mine")
    assert _nav_links(web) == RENTER | PROVIDER and ">Provide GPUs</a>" not in web.get("/").content.decode()


@pytest.mark.django_db
def test_operators_see_theirs(operator):
    assert _nav_links(logged_in(operator)) == RENTER | {"/nodes/new/", "/admin/"}
    assert "/admin/" not in _nav_links(logged_in(UserFactory(email="not-staff@example.com")))


@pytest.mark.django_db
def test_the_current_page_and_its_menu_are_marked(web):
    page = web.get("/account/usage/").content.decode()
    assert 'href="/account/usage/" aria-current="page"' in page
    assert page.count('aria-current="page"') == 1
    assert '<details class="nav-group current" data-nav-group="money">' in page


def test_every_entry_names_a_known_audience_and_group():
    for entry in nav.NAV:
        assert entry.audience in nav.AUDIENCES and (entry.group is None or entry.group in nav.GROUPS), entry


@pytest.mark.django_db
def test_an_entry_whose_page_does_not_exist_yet_is_left_out(web, monkeypatch):
    monkeypatch.setattr(nav, "NAV", [*nav.NAV, nav.NavLink("Webhooks", "no-such-page", "user", "account")])
    assert "Webhooks" not in web.get("/").content.decode()
    monkeypatch.setattr(nav, "NAV", [*nav.NAV, nav.NavLink("Password", "ssh-keys", "user", "account")])
    assert ">Password</a>" in web.get("/").content.decode()


@pytest.mark.django_db
def test_admin_pages_do_not_pay_for_the_navigation(operator, django_assert_max_num_queries):
    """The context processor is lazy: the admin draws its own navigation, so no query is made for ours."""
    client = Client()
    client.force_login(operator)
    client.get("/admin/marketplace/gpumodel/")
    with django_assert_max_num_queries(50) as captured:
        client.get("/admin/marketplace/gpumodel/")
    assert not any('"marketplace_node"' in q["sql"] and "LIMIT 1" in q["sql"] for q in captured.captured_queries)


# ------------------------------------------------------------------------------------ in a browser

@pytest.mark.slow
def test_the_phone_menu_opens_and_closes_under_the_csp(live_server, new_page, strict_csp, renter, shot):  # noqa: F811
    from tests.web.test_browser import log_in

    page = new_page(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    log_in(page, live_server.url, "renter@example.com")
    page.goto(f"{live_server.url}/offers/")
    toggle = page.get_by_role("button", name="Menu")
    assert toggle.is_visible() and toggle.get_attribute("aria-expanded") == "false"
    header = page.locator(".site-header").bounding_box()
    assert header["height"] < 80, header  # one line: brand and Menu
    assert not page.get_by_role("link", name="Instances").is_visible()
    toggle.click()
    assert toggle.get_attribute("aria-expanded") == "true"
    page.get_by_role("link", name="Instances").wait_for()
    page.locator("summary", has_text="Account").click()
    shot(page, "menu-phone", full_page=False)
    page.get_by_role("link", name="SSH keys").click()
    page.wait_for_url(re.compile(r"/account/ssh-keys/$"))
    assert page.get_by_role("button", name="Menu").get_attribute("aria-expanded") == "false"
    page.get_by_role("button", name="Menu").click()
    page.keyboard.press("Escape")
    assert page.get_by_role("button", name="Menu").get_attribute("aria-expanded") == "false"
    assert page.evaluate("document.scrollingElement.scrollWidth <= window.innerWidth")
    assert not page.errors


@pytest.mark.slow
@pytest.mark.parametrize("width", [1280, 1366])
def test_the_navigation_is_one_line_on_a_desktop(live_server, new_page, strict_csp, operator, width):
    from tests.web.test_browser import log_in

    make_node(operator, name="ops-own")  # every group: a provider who is also an operator
    page = new_page(viewport={"width": width, "height": 900})
    log_in(page, live_server.url, "ops@example.com")
    page.goto(f"{live_server.url}/account/balance/")
    assert not page.get_by_role("button", name="Menu").is_visible()
    tops = page.evaluate("[...document.querySelectorAll('#nav-menu > li, #site-nav > .brand')]"
                         ".map(el => Math.round(el.getBoundingClientRect().top))")
    assert len(tops) >= 8 and max(tops) - min(tops) <= 8, tops  # all on one line
    menu = page.locator("summary", has_text="Billing")
    menu.click()
    page.get_by_role("link", name="Statements", exact=True).wait_for()
    page.locator("summary", has_text="Account").click()  # opening one menu closes the other
    assert not page.get_by_role("link", name="Statements", exact=True).is_visible()
    page.keyboard.press("Escape")
    assert not page.get_by_role("link", name="SSH keys").is_visible()
    assert not page.errors


@pytest.fixture
def strict_csp(settings):
    from config.settings.csp import content_security_policy

    settings.CONTENT_SECURITY_POLICY = content_security_policy()
    return settings.CONTENT_SECURITY_POLICY
