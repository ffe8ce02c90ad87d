"""What a person sees in a real browser (issue 16): Rent without sideways scrolling at desktop widths, the rent
page's key and estimate, a provider's form error in view after submitting, and the state colours' contrast on
offline and rejected servers. Money in cents (prices per unit exact) and no sideways scrolling on a phone are checked
on every page by tests/web/test_every_page.py, with this module's `odd_money` data and FINE_AMOUNTS.

Headless Chromium (Playwright) against the live server, with the data of test_csp's `marketplace` fixture.
"""
import re

import pytest

from marketplace.models import SshKey
from tests.factories import make_listed_node
from tests.marketplace.mig_helpers import SEVEN, make_mig_node
from tests.web.test_browser import log_in
from tests.web.test_csp import marketplace  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow

NO_SIDEWAYS_SCROLL = "document.scrollingElement.scrollWidth <= window.innerWidth"
# A currency figure with more than two decimals: "$1.234", "−$0.005", "$1,234.5678".
FINE_MONEY = re.compile(r"\$\s?[\d,]*\.\d{3,}")
# The figures past cents on the page that are not a price per unit. A price per GPU-hour, slice-hour, hour or
# GB-month shows its every significant decimal (the `usd_rate` filter: what is charged and filtered on); an amount
# (a balance, a total, a charge) reads in cents. A rate is told by what follows it ("per …", "/h"), or by its table
# cell's label or row heading naming "per".
FINE_AMOUNTS = r"""() => {
  const fine = /\$\s?[\d,]*\.\d{3,}/g, per = /^\s*(per\b|\/h\b)/i, found = [];
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  while (walker.nextNode()) {
    const node = walker.currentNode, el = node.parentElement;
    if (!el || el.closest("script, style") || !el.getClientRects().length) continue;
    for (const m of node.textContent.matchAll(fine)) {
      const after = node.textContent.slice(m.index + m[0].length);
      const next = after.trim() ? after : (el.nextSibling ? el.nextSibling.textContent : "");
      const cell = el.closest("td, th"), row = el.closest("tr");
      const label = (cell && cell.getAttribute("data-label")) || "";
      const heading = row && row.querySelector("th") ? row.querySelector("th").textContent : "";
      if (per.test(after.trim() ? after : next) || /\bper\b/i.test(label) || /\bper\b/i.test(heading)) continue;
      found.push(m[0]);
    }
  }
  return found;
}"""


@pytest.fixture
def wide_offers(marketplace):  # noqa: F811 (the fixture imported above)
    """Offers with the longest figures a row can have: a long model name, city and country, a four-digit price,
    every host figure measured and NVLink with its p2p figure (the second lines under the GPU and the place)."""
    from marketplace.models import Node

    node = make_listed_node(marketplace["provider"], name="long-row", gpu_model="rtx-4090", gpu_count=16,
                            price="1234.567891", country="US", city="Saint-Pierre-des-Corps")
    Node.objects.filter(pk=node.pk).update(
        cpu_cores=256, ram_gb=2048, disk_free_gb=123456, cuda_version=12080, pcie_gen=5, pcie_width=16,
        driver_version="570.124.06", benchmark_summary={
            "verdict": "verified", "median_per_gpu": {"bf16_tflops": 165.2},
            "nvlink": {"connected": True, "islands": [list(range(8)), list(range(8, 16))], "links_per_gpu": 18,
                       "p2p_gbs": 1234.5, "pcie_p2p_gbs": 55.5}})
    return marketplace


@pytest.mark.parametrize("who", ["visitor", "provider@example.com"])  # the provider: the longest navigation
@pytest.mark.parametrize("width", [1280, 1366])
def test_rent_is_in_view_without_scrolling_sideways(live_server, new_page, wide_offers, width, who):
    page = new_page(viewport={"width": width, "height": 900})
    if who != "visitor":
        log_in(page, live_server.url, who)
    page.goto(f"{live_server.url}/offers/")
    buttons = page.get_by_role("link", name=re.compile(r"^Rent "))
    assert buttons.count() == 3
    assert page.evaluate(NO_SIDEWAYS_SCROLL), page.evaluate("document.scrollingElement.scrollWidth")
    wrap = page.locator(".table-wrap").first
    assert wrap.evaluate("el => el.scrollWidth <= el.clientWidth"), \
        wrap.evaluate("el => [el.scrollWidth, el.clientWidth]")
    right = wrap.bounding_box()["x"] + wrap.bounding_box()["width"]
    for i in range(buttons.count()):
        box = buttons.nth(i).bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= min(right, width), (width, box, right)
    checks = page.locator("table.offers tbody .badge")
    assert checks.count() == 3 and checks.first.bounding_box()["x"] + checks.first.bounding_box()["width"] <= width


def _in_view(page, selector: str) -> bool:
    return page.locator(selector).evaluate(
        "el => { const r = el.getBoundingClientRect();"
        " return r.top >= 0 && r.bottom <= window.innerHeight && r.left >= 0 && r.right <= window.innerWidth; }")


@pytest.mark.parametrize("price", ["-1", "1.2345678", "1000"])
def test_a_providers_price_error_is_in_view_after_saving(live_server, new_page, marketplace, price):  # noqa: F811
    page = new_page(viewport={"width": 1366, "height": 900})
    log_in(page, live_server.url, "provider@example.com")
    page.goto(f"{live_server.url}/nodes/{marketplace['rejected'].pk}/")
    field = page.get_by_label("Price per GPU-hour", exact=False)
    field.fill(price)
    page.get_by_role("button", name="Save").click()
    page.wait_for_load_state()
    errors = page.locator("#id_price_per_gpu_hour_errors")
    errors.wait_for()
    assert page.evaluate("window.scrollY") > 0  # the form is not at the top of this page
    assert page.evaluate("document.activeElement.id") == "id_price_per_gpu_hour"
    assert _in_view(page, "#id_price_per_gpu_hour_errors") and _in_view(page, "#id_price_per_gpu_hour")


@pytest.fixture
def odd_money(wide_offers):
    """Amounts with six decimals everywhere: an odd price, an odd credit, and 777 s of closed usage."""
    from datetime import timedelta

    from billing.services.ledger import credit_grant
    from billing.services.metering import usage_close
    from marketplace.models import Instance, Node

    data = wide_offers
    Node.objects.filter(pk=data["listed"].pk).update(price_per_gpu_hour_micros=1_234_567)
    credit_grant(user=data["renter"], amount_micros=12_345_678, reason="tests: an odd credit")
    instance = Instance.objects.get(pk=data["instance"].pk)
    usage_close(instance=instance, until=instance.started_at + timedelta(seconds=777))
    # A split A100 with odd slice prices: its rent page (slices only) and its server page (slices, MIG form)
    mig = make_mig_node({0: ["3g.40gb", "3g.40gb"], 1: SEVEN}, {"3g.40gb": "0.777777", "1g.10gb": "0.234567"},
                        provider=data["provider"], name="split-a100")
    return {**data, "mig": mig}


def test_rent_ticks_the_only_key_estimates_and_books_at_once(live_server, new_page, marketplace):  # noqa: F811
    from billing.services.ledger import wallet_balance
    from marketplace.models import Instance

    renter, listed = marketplace["renter"], marketplace["listed"]
    balance = wallet_balance(user_id=renter.pk)
    committed = 2 * listed.price_per_gpu_hour_micros  # the running instance: 2 GPUs at $1.50
    page = new_page(viewport={"width": 1366, "height": 900})
    log_in(page, live_server.url, "renter@example.com")
    page.goto(f"{live_server.url}/offers/{listed.pk}/rent/")
    only = SshKey.objects.get(user=renter)
    assert page.get_by_label(re.compile(re.escape(only.name))).is_checked()
    estimate = page.locator("#estimate")
    text = " ".join(estimate.inner_text().split())
    assert "1 GPU × $1.50 per GPU-hour = $1.50 per hour" in text, text
    assert "($3.00 per hour) you would pay $4.50 per hour in all" in text, text
    hours = balance / (committed + 1_500_000)  # $100 at $4.50/h: 22 h 13 min
    assert f"lasts about {int(hours)} h {int(hours * 60 % 60):02d} min" in text, (text, hours)
    page.get_by_label("Number of GPUs").fill("2")  # site.js follows the number typed
    hours = balance / (committed + 3_000_000)
    estimate.get_by_text("$6.00").wait_for()
    text = " ".join(estimate.inner_text().split())
    assert "2 GPUs × $1.50 per GPU-hour = $3.00 per hour" in text and "you would pay $6.00 per hour" in text, text
    assert f"lasts about {int(hours)} h {int(hours * 60 % 60):02d} min" in text, (text, hours)
    page.get_by_role("button", name="Rent now").click()  # the first try works: the key was ticked
    page.wait_for_url(re.compile(r"/instances/\d+/$"))
    assert Instance.objects.filter(renter=renter).count() == 2 and not page.errors


def test_rent_a_mig_slice_estimates_per_slice_hour_and_books(live_server, new_page, marketplace):  # noqa: F811
    from marketplace.models import Instance

    renter = marketplace["renter"]
    split = make_mig_node({0: ["3g.40gb", "3g.40gb"], 1: SEVEN}, {"3g.40gb": "0.70", "1g.10gb": "0.25"},
                          provider=marketplace["provider"], name="split-a100")
    page = new_page(viewport={"width": 1366, "height": 900})
    log_in(page, live_server.url, "renter@example.com")
    page.goto(f"{live_server.url}/offers/{split.pk}/rent/")
    estimate = page.locator("#estimate")
    text = " ".join(estimate.inner_text().split())
    assert "1 MIG 1g.10gb slice × $0.25 per slice-hour = $0.25 per hour" in text, text
    page.get_by_label(re.compile(r"MIG 3g\.40gb slices")).check()  # site.js follows the profile chosen
    page.get_by_label("Number of GPUs or slices").fill("2")
    estimate.get_by_text("$1.40").wait_for()
    text = " ".join(estimate.inner_text().split())
    assert "2 MIG 3g.40gb slices × $0.70 per slice-hour = $1.40 per hour" in text, text
    page.get_by_role("button", name="Rent now").click()
    page.wait_for_url(re.compile(r"/instances/\d+/$"))
    booked = Instance.objects.filter(renter=renter, node=split).get()
    assert (booked.mig_profile, booked.num_gpus, booked.price_per_hour_micros) == ("3g.40gb", 2, 1_400_000)
    assert not page.errors


# The WCAG contrast of an element's text against the first opaque background behind it (AA: 4.5:1).
CONTRASTS = """() => {
  const rgb = s => s.match(/[\\d.]+/g).map(Number);
  const linear = x => { x /= 255; return x <= 0.03928 ? x / 12.92 : ((x + 0.055) / 1.055) ** 2.4; };
  const lum = c => { const v = c.slice(0, 3).map(linear); return 0.2126 * v[0] + 0.7152 * v[1] + 0.0722 * v[2]; };
  const behind = el => { for (; el; el = el.parentElement) { const c = rgb(getComputedStyle(el).backgroundColor);
                         if (c.length < 4 || c[3] > 0) return c; } return [255, 255, 255]; };
  return [...document.querySelectorAll("main .badge, main .muted, main .panel *")].filter(el => el.innerText.trim())
    .map(el => { const a = lum(rgb(getComputedStyle(el).color)), b = lum(behind(el));
                 return [el.innerText.trim().slice(0, 30), (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05)]; });
}"""


def test_state_colours_keep_their_contrast_on_offline_and_rejected_nodes(
        live_server, new_page, marketplace):  # noqa: F811 (the fixture imported above)
    from marketplace.models import NodeState
    from tests.factories import make_node

    offline = make_node(marketplace["provider"], name="gone", state=NodeState.OFFLINE, verdict="verified")
    page = new_page(viewport={"width": 1366, "height": 900})
    log_in(page, live_server.url, "provider@example.com")
    low = []
    for url in ("/nodes/", f"/nodes/{marketplace['rejected'].pk}/", f"/nodes/{offline.pk}/"):
        page.goto(live_server.url + url)
        found = page.evaluate(CONTRASTS)
        assert found, url
        low += [(url, text, round(ratio, 2)) for text, ratio in found if ratio < 4.5]
    assert not low, low
