"""Whatever a client sends to /compat/vast, the answer is JSON and never a 500 (the CLI prints `msg`)."""
import itertools

import pytest

from tests.factories import make_listed_node

V0 = "/compat/vast/api/v0"
ROUTES = [f"{V0}/bundles/", f"{V0}/asks/{{offer}}/", "/compat/vast/api/v1/instances/", f"{V0}/instances/1/",
          f"{V0}/instances/filters/", f"{V0}/users/current", f"{V0}/ssh/", f"{V0}/ssh/1/", f"{V0}/machines",
          f"{V0}/machines/create_asks/", f"{V0}/machines/{{node}}", f"{V0}/machines/{{node}}/asks/",
          f"{V0}/asks/{'9' * 30}/", f"{V0}/instances/{'9' * 18}/"]
BODIES = [None, [], "text", 5, {"x": 1}, {"state": [1]}, {"state": "running", "label": {"a": 1}},
          {"label": 7}, {"ssh_key": None}, {"ssh_key": ["x"]}, {"machine": 1.5}, {"machine": "{node}"},
          {"machine": True, "price_gpu": "NaN"}, {"price_gpu": "1e999"}, {"min_chunk": "x"},
          {"image": ["x"]}, {"disk": "big"}, {"disk": 1e300, "image": "cuda-12-4"}, {"env": "-e A=1"},
          {"runtype": 3}, {"order": [[1, 2]]}, {"order": [["score"]]}, {"limit": "\u00b2"}, {"limit": 10**40},
          {"num_gpus": {"in": [{"a": 1}]}}, {"gpu_name": {"eq": ["x"]}}, {"id": {"gte": None}},
          {"allocated_storage": "lots"}, {"type": ["bid"]}, {"dph_total": {"lte": -1}},
          {"geolocation": {"eq": "Atlantis"}}, {"num_gpus": {"eq": 10**30}}, {"num_gpus": {"eq": 10**400}},
          {"dph_total": {"in": [10**400]}}, {"disk": 10**400, "image": "cuda-12-4"},
          {"image": "cuda\x00x", "disk": 10}, {"state": "bogus", "label": "CHANGED"}]
QUERIES = ["", "?select_filters=%7B", "?select_filters=%5B%5D", "?order_by=%7B%7D", "?limit=%C2%B2",
           "?after_token=-1", "?select_filters=%7B%22label%22%3A%7B%22gt%22%3A5%7D%7D",
           "?order_by=%5B%7B%22col%22%3A%22label%22%2C%22dir%22%3A%22desc%22%7D%5D", "?owner=me",
           "?select_filters=" + "[" * 1500 + "]" * 1500, "?order_by=" + "[" * 100 + "]" * 100]


@pytest.mark.parametrize("route", ROUTES)
def test_no_input_is_a_500_or_html(route, client_for, anon, market_node):
    node, owner = market_node
    url = route.format(offer=node.pk * 100 + 1, node=node.pk)
    owner_api = client_for(owner)
    for client, method, body in itertools.product([anon, owner_api], ["get", "post", "put", "delete"], BODIES):
        if isinstance(body, dict) and body.get("machine") == "{node}":
            body = {**body, "machine": node.pk}
        call = getattr(client, method)
        response = call(url, body, format="json") if method != "get" else call(url)
        assert response.status_code < 500, (method, url, body, response.content)
        assert response["Content-Type"] == "application/json", (method, url, body)
        if response.status_code >= 400:
            assert response.json()["msg"], (method, url, body)
    for query in QUERIES:
        response = owner_api.get(url + query)
        assert response.status_code < 500 and response["Content-Type"] == "application/json", (url, query)


@pytest.fixture
def market_node(db):
    node = make_listed_node(gpu_model="rtx-a4000", gpu_count=2)
    return node, node.provider


def test_odd_bytes_in_the_url_are_a_json_400(api):
    response = api.get("/compat/vast/api/v0/instances/1%00/")
    assert response.status_code == 400 and response.json()["msg"]
