"""The server page's Save of a cleared MIG layout, the prices left as shown, turns MIG off (found by review): it was
refused over the stored price of a profile the empty layout no longer used (tests/marketplace/
test_round50_mig_layout_drops_prices.py has the API's side)."""
import html
import re

import pytest

from tests.factories import make_node

pytestmark = pytest.mark.django_db


def test_the_page_clears_the_layout_alone(web, renter):
    node = make_node(renter, name="split-me", gpu_model="a100-80gb-sxm", gpu_count=2)
    r = web.post(f"/nodes/{node.pk}/mig/", {"mig_layout": "GPU 0: 3g.40gb, 3g.40gb", "mig_prices": "3g.40gb: 0.70"})
    assert r.status_code == 302
    page = web.get(f"/nodes/{node.pk}/").content.decode()
    data = {f"initial-{name}": html.unescape(re.search(rf'name="initial-{name}" value="([^"]*)"', page)[1])
            for name in ("mig_layout", "mig_prices")}
    data |= {"mig_layout": "", "mig_prices": data["initial-mig_prices"]}  # the layout cleared, the prices as shown
    r = web.post(f"/nodes/{node.pk}/mig/", data)
    assert r.status_code == 302, r.content.decode()[:2000]
    node.refresh_from_db()
    assert node.mig_layout == [] and node.mig_prices_micros == {}
