"""The server page's settings form changes only what its user changed since the page was opened (the form carries
the values it showed, Django's show_hidden_initial): an operator's unlisting while the page was open was undone
by a price-only save, which sent `listed` and `maintenance` as they were when the page was opened (found by
review)."""
import html
import re
from decimal import Decimal

import pytest

from marketplace.models import Node, NodeState
from marketplace.services import nodes as svc
from tests.factories import make_listed_node

pytestmark = pytest.mark.django_db


def _form_data(page: str, action: str) -> dict:
    """The settings form's fields as the browser would send them (checked boxes only)."""
    form = re.search(rf'<form method="post" action="{re.escape(action)}".*?</form>', page, re.S).group(0)
    data = {}
    for tag in re.findall(r"<input[^>]*>", form):
        name = re.search(r'name="([^"]+)"', tag)
        if not name or name[1] == "csrfmiddlewaretoken":
            continue
        if 'type="checkbox"' in tag:
            if " checked" in tag:
                data[name[1]] = "on"
            continue
        value = re.search(r'value="([^"]*)"', tag)
        data[name[1]] = html.unescape(value[1]) if value else ""
    return data


def test_a_price_only_save_keeps_an_unlisting_made_while_the_page_was_open(web, renter):
    node = make_listed_node(renter, gpu_model="rtx-a4000", gpu_count=2, price="0.300000")
    action = f"/nodes/{node.pk}/settings/"
    data = _form_data(web.get(f"/nodes/{node.pk}/").content.decode(), action)
    assert data["listed"] == "on" and "maintenance" not in data
    svc.node_update(node=node, listed=False)  # an operator (or the API) unlists it meanwhile
    data["price_per_gpu_hour"] = "0.25"
    r = web.post(action, data)
    assert r.status_code == 302, r.content.decode()[:2000]
    node = Node.objects.get(pk=node.pk)
    assert node.price_per_gpu_hour_micros == 250_000 and not node.listed and node.state == NodeState.ACTIVE


def test_a_listing_save_keeps_a_price_changed_while_the_page_was_open(web, renter):
    node = make_listed_node(renter, gpu_model="rtx-a4000", gpu_count=2, price="0.300000")
    action = f"/nodes/{node.pk}/settings/"
    data = _form_data(web.get(f"/nodes/{node.pk}/").content.decode(), action)
    svc.node_update(node=node, price_per_gpu_hour=Decimal("0.40"))  # through the API, meanwhile
    data.pop("listed")  # the provider unticks Listed only
    assert web.post(action, data).status_code == 302
    node = Node.objects.get(pk=node.pk)
    assert node.price_per_gpu_hour_micros == 400_000 and not node.listed


def test_what_the_user_changed_is_saved_and_an_error_keeps_what_the_page_showed(web, renter):
    node = make_listed_node(renter, gpu_model="rtx-a4000", gpu_count=2, price="0.300000")
    action = f"/nodes/{node.pk}/settings/"
    data = _form_data(web.get(f"/nodes/{node.pk}/").content.decode(), action)
    data.update(price_per_gpu_hour="abc", maintenance="on")
    r = web.post(action, data)
    assert r.status_code == 400
    again = _form_data(r.content.decode(), action)  # the page again, still carrying what it first showed
    svc.node_update(node=node, listed=False)
    again["price_per_gpu_hour"] = "0.30"
    assert web.post(action, again).status_code == 302
    node = Node.objects.get(pk=node.pk)
    assert node.state == NodeState.MAINTENANCE and not node.listed and node.price_per_gpu_hour_micros == 300_000
