"""The server page's MIG form wrote the layout and the prices together, as the page showed them (found by review): a
Save made for the prices wrote back the layout the page had shown over one declared meanwhile (through the API, or
the page in another tab), and a Save made for the layout the prices. Each field now carries the text the page showed,
and the save writes only what its user changed; the service checks it with the other as stored."""
import html
import re
from decimal import Decimal

import pytest

from marketplace.services.nodes import node_update
from tests.factories import make_node

pytestmark = pytest.mark.django_db


@pytest.fixture
def a100(renter):
    node = make_node(renter, name="split-me", gpu_model="a100-80gb-sxm", gpu_count=2)
    return node_update(node=node, mig_layout=[{"gpu": 0, "profiles": ["3g.40gb", "3g.40gb"]}],
                       mig_prices={"3g.40gb": Decimal("0.70")})


def _page_form(web, node) -> dict:
    page = web.get(f"/nodes/{node.pk}/").content.decode()
    data = {}
    for name in ("mig_layout", "mig_prices"):
        shown = re.search(rf'name="initial-{name}" value="([^"]*)"', page)
        assert shown, f"the page sends no {name} it showed"
        data[f"initial-{name}"] = html.unescape(shown[1])
        data[name] = html.unescape(re.search(rf'<textarea name="{name}"[^>]*>\n?([^<]*)</textarea>', page)[1])
    return data


def test_a_price_save_keeps_a_layout_declared_since_the_page_opened(web, a100):
    data = _page_form(web, a100)
    assert data["mig_layout"] == "GPU 0: 3g.40gb, 3g.40gb"
    # Meanwhile, through the API: the second card split too.
    node_update(node=a100, mig_layout=[{"gpu": 0, "profiles": ["3g.40gb", "3g.40gb"]},
                                       {"gpu": 1, "profiles": ["3g.40gb", "3g.40gb"]}])
    data["mig_prices"] = "3g.40gb: 0.80"
    r = web.post(f"/nodes/{a100.pk}/mig/", data)
    assert r.status_code == 302, r.content.decode()[:3000]
    a100.refresh_from_db()
    assert a100.mig_layout == [{"gpu": 0, "profiles": ["3g.40gb", "3g.40gb"]},
                               {"gpu": 1, "profiles": ["3g.40gb", "3g.40gb"]}]
    assert a100.mig_prices_micros == {"3g.40gb": 800_000}


def test_a_layout_save_keeps_prices_set_since_the_page_opened(web, a100):
    data = _page_form(web, a100)
    node_update(node=a100, mig_prices={"3g.40gb": Decimal("0.95")})
    data["mig_layout"] = "GPU 0: 3g.40gb, 3g.40gb\nGPU 1: 3g.40gb"
    assert web.post(f"/nodes/{a100.pk}/mig/", data).status_code == 302
    a100.refresh_from_db()
    assert a100.mig_layout[1] == {"gpu": 1, "profiles": ["3g.40gb"]}
    assert a100.mig_prices_micros == {"3g.40gb": 950_000}


def test_a_save_that_changed_nothing_writes_nothing(web, a100):
    data = _page_form(web, a100)
    node_update(node=a100, mig_layout=[], mig_prices={})  # the MIG declaration taken away meanwhile
    data["mig_layout"] = "GPU 0:3g.40gb,3g.40gb\n\n"  # the same layout, typed otherwise
    assert web.post(f"/nodes/{a100.pk}/mig/", data).status_code == 302
    a100.refresh_from_db()
    assert a100.mig_layout == [] and a100.mig_prices_micros == {}


def test_a_post_without_the_pages_values_is_written_as_sent(web, a100):
    """A client that sends no page's values (a script) claims none: what differs from the stored declaration is
    written, as before."""
    r = web.post(f"/nodes/{a100.pk}/mig/", {"mig_layout": "GPU 1: 7g.80gb", "mig_prices": "7g.80gb: 1.60"})
    assert r.status_code == 302
    a100.refresh_from_db()
    assert a100.mig_layout == [{"gpu": 1, "profiles": ["7g.80gb"]}] and a100.mig_prices_micros == {"7g.80gb": 1_600_000}
