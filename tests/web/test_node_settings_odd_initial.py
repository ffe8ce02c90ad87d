"""The server settings form reads the value its page showed from a hidden field (show_hidden_initial); a hidden
price of "sNaN" parsed to a signalling NaN, which raised decimal.InvalidOperation when compared with the posted
price: a 500 (found by review). A shown value the page could not have shown counts as changed."""

import pytest

from marketplace.models import Node
from tests.factories import make_listed_node

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("shown", ["sNaN", "-sNaN", "NaN", "Infinity", "1e999999999"])
def test_node_settings_with_a_non_finite_initial_price_is_no_500(web, renter, shown):
    node = make_listed_node(renter, gpu_model="a100-80gb-sxm", gpu_count=2, price="0.300000")
    web.raise_request_exception = False
    r = web.post(f"/nodes/{node.pk}/settings/", {"price_per_gpu_hour": "1", "listed": "on",
                                                  "initial-price_per_gpu_hour": shown})
    assert r.status_code == 302, r.status_code
    node = Node.objects.get(pk=node.pk)
    assert node.price_per_gpu_hour_micros == 1_000_000 and node.listed  # the price as sent


def test_node_settings_with_a_signalling_nan_price_is_refused_on_the_form(web, renter):
    node = make_listed_node(renter, gpu_model="a100-80gb-sxm", gpu_count=2, price="0.300000")
    web.raise_request_exception = False
    r = web.post(f"/nodes/{node.pk}/settings/", {"price_per_gpu_hour": "sNaN", "initial-price_per_gpu_hour": "0.3"})
    assert r.status_code == 400 and 'id="id_price_per_gpu_hour_errors"' in r.content.decode()
    assert Node.objects.get(pk=node.pk).price_per_gpu_hour_micros == 300_000
