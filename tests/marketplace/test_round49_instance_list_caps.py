"""The list fields of POST /api/v1/instances/ (and /nodes/' mig_prices) are capped before their items are worked on
(found by review, r49).

`ssh_keys` looked each id up in a query of its own before its 32-key cap was checked, and took 1.5 or "1" for key 1;
`volumes` validated every item before its 8-item cap; `mig_prices` parsed every price before any was refused.
Query counts and behaviour only: no timings."""

import json

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from drf_spectacular.generators import SchemaGenerator

from core.api.fields import UsdField
from marketplace.api import instance_serializers
from marketplace.mig import all_profile_names
from marketplace.models import Instance, Node
from marketplace.validators import MAX_INSTANCE_KEYS
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import add_key, ed25519_key, sent_jobs_fixture  # noqa: F401
from tests.marketplace.test_api_nodes import valid_payload

pytestmark = pytest.mark.django_db
URL = "/api/v1/instances/"


def _book(api, node, **fields):
    body = {"offer": node.pk, "num_gpus": 1, "image": "pytorch-2-5", **fields}
    return api.post(URL, json.dumps(body), content_type="application/json")


def test_a_long_ssh_keys_list_is_refused_before_any_id_is_looked_up(api, user):
    node = make_listed_node()
    key = add_key(user)
    with CaptureQueriesContext(connection) as queries:
        r = _book(api, node, ssh_keys=[key.pk] * 5_000)
    assert r.status_code == 400 and r.json() == {"ssh_keys": [f"At most {MAX_INSTANCE_KEYS} keys."]}
    assert not Instance.objects.exists()
    assert not [q for q in queries if "marketplace_sshkey" in q["sql"]], "an id was looked up before the cap"
    assert len(queries) < 20, len(queries)


def test_the_keys_are_found_in_one_query_in_the_order_given(api, user, sent_jobs):  # noqa: F811
    node = make_listed_node()
    keys = [add_key(user, name=f"k{n}") for n in range(MAX_INSTANCE_KEYS)]
    ids = [k.pk for k in reversed(keys)]
    serializer = instance_serializers.InstanceCreateSerializer(
        data={"offer": node.pk, "num_gpus": 1, "image": "pytorch-2-5", "ssh_keys": ids},
        context={"request": type("R", (), {"user": user})()},
    )
    with CaptureQueriesContext(connection) as queries:
        assert serializer.is_valid(), serializer.errors
    assert [k.pk for k in serializer.validated_data["ssh_keys"]] == ids
    assert len([q for q in queries if "marketplace_sshkey" in q["sql"]]) == 1


def test_an_unknown_or_foreign_key_id_is_still_refused(api, user):
    node = make_listed_node()
    other = add_key(UserFactory())
    mine = add_key(user)
    for ids in ([mine.pk, other.pk], [mine.pk, 2**62], [0]):
        r = _book(api, node, ssh_keys=ids)
        assert r.status_code == 400, r.content
        assert r.json()["ssh_keys"] == [f'Invalid pk "{ids[-1]}" - object does not exist.']
    assert not Instance.objects.exists()


@pytest.mark.parametrize(
    "wrong",
    [lambda pk: pk + 0.5, str, lambda pk: float(pk), lambda pk: True, lambda pk: [pk], lambda pk: {"id": pk}],
    ids=["1.5", "string", "1.0", "true", "list", "object"],
)
def test_an_ssh_key_id_that_is_not_a_json_integer_is_refused(api, user, wrong):
    node = make_listed_node()
    key = add_key(user)
    r = _book(api, node, ssh_keys=[key.pk, wrong(key.pk)])
    assert r.status_code == 400, r.content[:200]
    (message,) = r.json()["ssh_keys"]
    assert message.startswith("ssh_keys[1] must be an integer"), message
    assert not Instance.objects.exists()


def test_ssh_keys_publishes_its_cap():
    schema = SchemaGenerator().get_schema(request=None, public=True)
    ssh_keys = schema["components"]["schemas"]["InstanceCreateRequest"]["properties"]["ssh_keys"]
    assert ssh_keys["maxItems"] == MAX_INSTANCE_KEYS and ssh_keys["items"] == {"type": "integer"}
    assert ssh_keys["description"].startswith("Ids of your SSH keys")


def test_a_long_volumes_list_is_refused_before_its_items_are_validated(api, user, monkeypatch):
    node = make_listed_node()
    seen = []
    real = instance_serializers.VolumeAttachSerializer.run_validation

    def counting(self, data=None):
        seen.append(data)
        return real(self, data)

    monkeypatch.setattr(instance_serializers.VolumeAttachSerializer, "run_validation", counting)
    r = _book(api, node, ssh_public_key=ed25519_key(), volumes=[{"volume": "x", "mount": "/a"}] * 10_000)
    assert r.status_code == 400
    assert r.json() == {"volumes": ["Ensure this field has no more than 8 elements."]}, r.content[:300]
    assert seen == [] and not Instance.objects.exists()


def test_a_node_with_more_mig_prices_than_the_catalogue_has_profiles_is_refused_before_they_are_parsed(
    api, monkeypatch
):
    parsed = []
    real = UsdField.to_internal_value

    def counting(self, data):
        parsed.append(data)
        return real(self, data)

    monkeypatch.setattr(UsdField, "to_internal_value", counting)
    prices = {f"{n}g.{n}gb": "0.80" for n in range(10_000)}
    payload = valid_payload(
        gpu_model="a100-80gb-sxm", runtime="sim", mig_prices=prices, mig_layout=[{"gpu": 0, "profiles": ["3g.40gb"]}]
    )
    r = api.post("/api/v1/nodes/", payload, format="json")
    most = len(all_profile_names())
    assert r.status_code == 400 and r.json() == {
        "mig_prices": [f"At most {most} prices (one per MIG profile of mig_layout); you gave 10000."]
    }, r.content[:300]
    assert [p for p in parsed if p == "0.80"] == []
    assert not Node.objects.exists()
