"""The create's fingerprint held a plain SHA-256 of the renter's onstart script (found by review): renters put tokens
in it (a secret field, core/admin_site.SECRET_FIELDS), and the instance's admin page showed the fingerprint with
every other field of the body, so a guess at the script could be checked offline. The script is now replaced by a
keyed hash before fingerprinting, on the rent page and in the API, as the env and the registry password were; an
empty one is left as sent (those fingerprints are unchanged), and the page shows no fingerprint."""
import pytest

from core.admin_site import lookup_reads_a_secret
from core.idempotency import WEB_KEY_PREFIX, request_fingerprint
from marketplace.models import Instance
from tests.conftest import _client_for
from tests.factories import make_listed_node
from tests.marketplace.renting_helpers import ed25519_key
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db


def test_the_stored_fingerprint_is_no_plain_hash_of_the_onstart_script(web, funded_renter):
    node = make_listed_node(gpu_model="rtx-a6000", gpu_count=1)
    body = {"image": "cuda-12-4", "num_gpus": "1", "ssh_public_key": ed25519_key(), "request_token": "tok123",
            "onstart": "export HF_TOKEN=hf_guessable"}
    assert web.post(f"/offers/{node.pk}/rent/", body).status_code == 302
    instance = Instance.objects.get(renter=funded_renter)
    guess = {"image": ["cuda-12-4"], "num_gpus": [str(instance.num_gpus)], "ssh_public_key": [body["ssh_public_key"]],
             "request_token": [instance.idempotency_key.removeprefix(WEB_KEY_PREFIX)],
             "onstart": ["export HF_TOKEN=hf_guessable"], "offer": instance.node_id}
    assert request_fingerprint(guess) != instance.request_fingerprint


def test_the_rent_form_sent_again_with_its_script_is_still_a_replay(web, funded_renter):
    node = make_listed_node(gpu_count=2)
    body = {"image": "cuda-12-4", "num_gpus": "1", "ssh_public_key": ed25519_key(), "request_token": "tok456",
            "onstart": "export HF_TOKEN=hf_secret"}
    first = web.post(f"/offers/{node.pk}/rent/", body)
    again = web.post(f"/offers/{node.pk}/rent/", body)
    assert first.status_code == again.status_code == 302 and first["Location"] == again["Location"]
    assert Instance.objects.filter(renter=funded_renter).count() == 1
    other = web.post(f"/offers/{node.pk}/rent/", {**body, "onstart": "export HF_TOKEN=hf_other"})
    assert other.status_code == 400 and "already used to book an instance with other choices" in other.content.decode()
    assert Instance.objects.filter(renter=funded_renter).count() == 1


def test_a_booking_without_a_script_keeps_the_fingerprint_it_had(web, funded_renter):
    """An empty script is left as posted: a form sent before this change and again after it is still a replay."""
    node = make_listed_node(gpu_count=1)
    body = {"image": "cuda-12-4", "num_gpus": "1", "ssh_public_key": ed25519_key(), "request_token": "tok789",
            "onstart": ""}
    assert web.post(f"/offers/{node.pk}/rent/", body).status_code == 302
    instance = Instance.objects.get(renter=funded_renter)
    assert instance.request_fingerprint == request_fingerprint(
        {**{k: [v] for k, v in body.items()}, "offer": node.pk})


def test_the_api_stores_no_plain_hash_of_the_onstart_script(funded_renter):
    api = _client_for(funded_renter)
    node = make_listed_node(gpu_count=2)
    data = {"offer": node.pk, "num_gpus": 1, "image": "cuda-12-4", "ssh_public_key": ed25519_key(),
            "onstart": "export HF_TOKEN=hf_guessable"}
    r = api.post("/api/v1/instances/", data, format="json", HTTP_IDEMPOTENCY_KEY="k-onstart")
    assert r.status_code == 201, r.content
    instance = Instance.objects.get(pk=r.json()["id"])
    assert instance.request_fingerprint and instance.request_fingerprint != request_fingerprint(data)
    retry = api.post("/api/v1/instances/", data, format="json", HTTP_IDEMPOTENCY_KEY="k-onstart")
    assert retry.status_code == 200 and retry.json()["id"] == instance.pk  # a retry still finds it
    other = api.post("/api/v1/instances/", {**data, "onstart": "echo other"}, format="json",
                     HTTP_IDEMPOTENCY_KEY="k-onstart")
    assert other.status_code == 422


def test_the_api_fingerprint_of_a_create_without_a_script_is_unchanged(funded_renter):
    api = _client_for(funded_renter)
    node = make_listed_node(gpu_count=1)
    data = {"offer": node.pk, "num_gpus": 1, "image": "cuda-12-4", "ssh_public_key": ed25519_key(), "onstart": ""}
    r = api.post("/api/v1/instances/", data, format="json", HTTP_IDEMPOTENCY_KEY="k-plain")
    assert r.status_code == 201, r.content
    assert Instance.objects.get(pk=r.json()["id"]).request_fingerprint == request_fingerprint(data)


def test_the_instance_admin_shows_no_fingerprint_and_refuses_lookups_by_it(web, funded_renter, operator):
    node = make_listed_node(gpu_count=1)
    body = {"image": "cuda-12-4", "num_gpus": "1", "ssh_public_key": ed25519_key(), "request_token": "tokadm",
            "onstart": "export HF_TOKEN=hf_guessable"}
    assert web.post(f"/offers/{node.pk}/rent/", body).status_code == 302
    instance = Instance.objects.get(renter=funded_renter)
    ops = logged_in(operator)
    page = ops.get(f"/admin/marketplace/instance/{instance.pk}/change/")
    assert page.status_code == 200 and instance.request_fingerprint not in page.content.decode()
    assert lookup_reads_a_secret(Instance, "request_fingerprint")
    r = ops.get(f"/admin/marketplace/instance/?request_fingerprint={instance.request_fingerprint}")
    assert r.status_code == 400
