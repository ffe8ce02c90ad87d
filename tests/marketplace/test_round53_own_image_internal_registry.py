"""Review r53 #3: a renter's own image may not name a registry inside the node's network. The node's dockerd pulls
it from inside the provider's network and the registry's error (connection refused, an HTTP answer) reached the
renter: a probe of the node's loopback and LAN, one booking per port. `localhost` (any case, any port, names under
.localhost) and IP literals that are not public (loopback, link-local, private, unspecified; numeric forms such as
`127.1` too) are refused with a 400 naming `image`, on the API and /compat/vast (the rent page: tests/web), nothing
written.
Public registries and names (not resolved) are taken; catalogue images (staff's) are not checked; an operator may
allow internal registries (settings.RENTER_INTERNAL_REGISTRIES, as tests/docker does for its 127.0.0.1 registry)."""
import pytest

from core.errors import ValidationFailed
from marketplace.models import Instance
from marketplace.services.instances import options as opts
from tests.compat.test_api import (
    _create,
    market,  # noqa: F401 (fixture)
)
from tests.factories import make_listed_node
from tests.marketplace.renting_helpers import add_key, ed25519_key

pytestmark = pytest.mark.django_db

INTERNAL = [
    ("127.0.0.1:2375/probe:1", "loopback"),
    ("localhost:8080/probe:1", "localhost"),
    ("LocalHost/probe:1", "localhost"),
    ("localhost/probe", "localhost"),
    ("registry.localhost:5000/probe:1", "localhost"),
    ("169.254.169.254:80/latest:1", "link-local"),
    ("10.0.0.5:22/probe:1", "private"),
    ("192.168.1.1/probe:1", "private"),
    ("172.16.0.1:5000/probe:1", "private"),
    ("0.0.0.0:5000/probe:1", "unspecified"),
    ("127.1:5000/probe:1", "loopback"),  # what inet_aton (the C resolver) reads as 127.0.0.1
    ("2130706433:5000/probe:1", "loopback"),
    ("100.64.0.1:5000/probe:1", "address"),  # carrier-grade NAT: not public
]
PUBLIC = ["ubuntu:24.04", "ghcr.io/org/app:1", "registry.example.com:5000/team/app:1", "8.8.8.8:5000/app:1",
          "docker.io/library/ubuntu", "1234/app:1", "nvcr.io/nvidia/pytorch:24.05-py3", "localhostregistry.io/app:1"]


def _api_body(node, image):
    return {"offer": node.pk, "num_gpus": 1, "image": image, "ssh_public_key": ed25519_key("me@laptop")}


@pytest.mark.parametrize(("reference", "kind"), INTERNAL)
def test_a_renters_own_image_from_an_internal_registry_is_refused(api, reference, kind):
    node = make_listed_node(gpu_count=4)
    r = api.post("/api/v1/instances/", _api_body(node, reference), format="json")
    assert r.status_code == 400, r.content
    message = " ".join(r.json()["image"])
    assert "inside the node's network" in message and kind in message, message
    assert not Instance.objects.exists()
    with pytest.raises(ValidationFailed):
        opts.image_of(reference)


@pytest.mark.parametrize("reference", PUBLIC)
def test_public_registries_and_names_are_taken(api, reference):
    node = make_listed_node(gpu_count=4)
    r = api.post("/api/v1/instances/", _api_body(node, reference), format="json")
    assert r.status_code == 201, r.content
    assert Instance.objects.get(pk=r.json()["id"]).image_ref == reference


def test_catalogue_images_and_listed_internal_registries_are_not_checked(api, settings):
    assert opts.clean_image_reference("127.0.0.1:5000/platform/ssh:1") == "127.0.0.1:5000/platform/ssh:1"
    settings.RENTER_INTERNAL_REGISTRIES = ["127.0.0.1:5000", "registry.localhost"]
    node = make_listed_node(gpu_count=4)
    for reference in ("127.0.0.1:5000/team/app:1", "registry.localhost:5000/team/app:1"):
        r = api.post("/api/v1/instances/", _api_body(node, reference), format="json")
        assert r.status_code == 201, r.content
    # host:port allows that port only
    r = api.post("/api/v1/instances/", _api_body(node, "127.0.0.1:2375/probe:1"), format="json")
    assert r.status_code == 400 and "loopback" in " ".join(r.json()["image"])


def test_compat_vast_refuses_it(api, market):  # noqa: F811
    _, a6000, _ = market
    add_key(api.user)
    r = _create(api, a6000.pk * 100 + 1, image="localhost:5000/app:1", image_login="-u me -p tok3n localhost:5000")
    assert r.status_code == 400, r.content
    assert "inside the node's network" in r.content.decode()
    assert not Instance.objects.exists()
