"""Registering a node (review r54, onboard #1, #4, #5).

- #1: registering resolves a host name the provider chose inside the web request and starts automatic SSH
  connections to it, yet it was neither throttled nor capped (40 registrations in a row: 40 nodes). Now the API's
  POST /api/v1/nodes/ and the register page share the `node_register` rate (NODE_REGISTER_THROTTLE_RATE), and a
  provider may have at most NODE_PENDING_MAX live nodes that never passed their first contact (a 409 naming the
  cap and what to do).
- #4: PLATFORM_NAME (in the key's comment) was spliced into single quotes in the install command: "Bob's GPUs"
  broke the line every provider copies.
- #5: "gpu1.example.com." and "gpu1.example.com" are one host, but were two addresses for the 409 on a second live
  node at the same address and port.
"""
import shutil
import subprocess

import pytest
from django.utils import timezone
from rest_framework import throttling as drf_throttling

from marketplace.models import Node, NodeState
from marketplace.validators import canonical_address
from tests.web.conftest import logged_in

from .test_api_nodes import URL, valid_payload

pytestmark = pytest.mark.django_db

PAGE = "/nodes/new/"
FORM = {"name": "rack1", "address": "LocalHost", "ssh_port": "2222", "ssh_user": "gpu", "host_key_fingerprint": "",
        "country": "DE", "gpu_model": "rtx-a6000", "gpu_count": "1", "price_per_gpu_hour": "0.79",
        "runtime": "docker"}


@pytest.fixture
def rate(monkeypatch):
    def set_rate(value):
        rates = {**drf_throttling.ScopedRateThrottle.THROTTLE_RATES, "node_register": value}
        monkeypatch.setattr(drf_throttling.ScopedRateThrottle, "THROTTLE_RATES", rates)
    return set_rate


# ------------------------------------------------------------------------------------------ #1 throttle


def test_the_default_rate_is_set_and_counted(api, settings):
    settings.NODE_PENDING_MAX = 100
    limit, _ = drf_throttling.ScopedRateThrottle().parse_rate(
        drf_throttling.ScopedRateThrottle.THROTTLE_RATES["node_register"])
    codes = [api.post(URL, valid_payload(name=f"n{i}", ssh_port=1000 + i), format="json").status_code
             for i in range(limit + 3)]
    assert codes == [201] * limit + [429] * 3, codes
    assert Node.objects.count() == limit


def test_a_throttled_registration_says_when_to_try_again_and_writes_nothing(api, settings, rate):
    settings.NODE_PENDING_MAX = 100
    rate("2/min")
    for port in (1001, 1002):
        assert api.post(URL, valid_payload(ssh_port=port, name=f"n{port}"), format="json").status_code == 201
    r = api.post(URL, valid_payload(ssh_port=1003, name="n1003"), format="json")
    assert r.status_code == 429, r.content
    assert int(r["Retry-After"]) >= 1
    assert "Too many servers registered" in r.json()["detail"] and "nothing was registered" in r.json()["detail"]
    assert Node.objects.count() == 2


def test_reading_and_changing_nodes_is_not_counted(api, settings, rate):
    rate("1/min")
    r = api.post(URL, valid_payload(), format="json")
    assert r.status_code == 201
    node_url = f"{URL}{r.json()['id']}/"
    for _ in range(3):
        assert api.get(URL).status_code == 200
        assert api.get(node_url).status_code == 200
        assert api.patch(node_url, {"name": "renamed"}, format="json").status_code == 200


def test_the_page_and_the_api_share_one_budget(api, user, settings, rate):
    settings.NODE_PENDING_MAX = 100
    rate("2/min")
    assert api.post(URL, valid_payload(ssh_port=1001, name="a"), format="json").status_code == 201
    web = logged_in(user)
    r = web.post(PAGE, {**FORM, "ssh_port": "1002"})
    assert r.status_code == 302, r.content.decode()[:1000]
    r = web.post(PAGE, {**FORM, "ssh_port": "1003", "name": "third"})
    assert r.status_code == 429
    assert int(r["Retry-After"]) >= 1
    assert "Too many servers registered" in r.content.decode()
    assert 'value="third"' in r.content.decode()  # the input is kept
    assert api.post(URL, valid_payload(ssh_port=1004, name="d"), format="json").status_code == 429
    assert Node.objects.count() == 2


# ------------------------------------------------------------------------------------------ #1 cap


def test_pending_nodes_are_capped_with_a_409_that_names_the_cap_and_the_way_out(api, user, settings):
    settings.NODE_PENDING_MAX = 2
    ids = [api.post(URL, valid_payload(ssh_port=port, name=f"n{port}"), format="json").json()["id"]
           for port in (1001, 1002)]
    r = api.post(URL, valid_payload(ssh_port=1003, name="third"), format="json")
    assert r.status_code == 409, r.content
    detail = r.json()["detail"]
    assert "(2)" in detail and "first contact" in detail and "retire" in detail and "verify" in detail
    assert Node.objects.count() == 2
    # A node that proved it controls its server no longer counts; neither does a retired one.
    Node.objects.filter(pk=ids[0]).update(control_proven_at=timezone.now(), state=NodeState.ACTIVE)
    assert api.post(URL, valid_payload(ssh_port=1003, name="third"), format="json").status_code == 201
    assert api.post(URL, valid_payload(ssh_port=1004, name="fourth"), format="json").status_code == 409
    assert api.delete(f"{URL}{ids[1]}/").status_code == 204
    assert api.post(URL, valid_payload(ssh_port=1004, name="fourth"), format="json").status_code == 201


def test_the_cap_is_counted_per_provider(api, other_api, settings):
    settings.NODE_PENDING_MAX = 1
    assert api.post(URL, valid_payload(), format="json").status_code == 201
    assert other_api.post(URL, valid_payload(), format="json").status_code == 201
    assert api.post(URL, valid_payload(ssh_port=1001, name="b"), format="json").status_code == 409


def test_the_page_shows_the_cap_above_the_form(user, settings):
    settings.NODE_PENDING_MAX = 1
    web = logged_in(user)
    assert web.post(PAGE, FORM).status_code == 302
    r = web.post(PAGE, {**FORM, "ssh_port": "2223", "name": "second"})
    page = r.content.decode()
    assert r.status_code in (400, 409)
    assert "the most a provider may have at once (1)" in page
    assert 'id="id_address_errors"' not in page  # not the address's fault
    assert Node.objects.count() == 1


def test_the_same_address_conflict_still_shows_under_address_on_the_page(user):
    web = logged_in(user)
    assert web.post(PAGE, FORM).status_code == 302
    r = web.post(PAGE, {**FORM, "name": "again"})
    assert r.status_code in (400, 409)
    assert "already registered at localhost:2222" in r.content.decode()
    assert 'id="id_address_errors"' in r.content.decode()


# ------------------------------------------------------------------------------------------ #4 install command


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("platform_name", ["Bob's GPUs", "a'b\"c $(touch pwned) `x`;d"],
                         ids=["apostrophe", "shell-metacharacters"])
def test_the_install_command_is_shell_quoted(api, settings, tmp_path, platform_name):
    settings.PLATFORM_NAME = platform_name
    r = api.post(URL, valid_payload(), format="json")
    assert r.status_code == 201, r.content
    body = r.json()
    command = body["install_command"]
    syntax = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True, check=False)
    assert syntax.returncode == 0, syntax.stderr
    home = tmp_path / "home"
    home.mkdir()
    run = subprocess.run(["bash", "-c", command], capture_output=True, text=True, check=False, cwd=tmp_path,
                         env={"HOME": str(home), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    assert (home / ".ssh" / "authorized_keys").read_text() == body["public_key"] + "\n"
    assert body["public_key"].endswith(f"{platform_name}-node-{body['id']}")
    assert not (tmp_path / "pwned").exists()


# ------------------------------------------------------------------------------------------ #5 trailing dot


@pytest.mark.parametrize("given,stored", [("gpu1.example.com.", "gpu1.example.com"),
                                          ("GPU1.Example.COM.", "gpu1.example.com"),
                                          ("gpu1.example.com", "gpu1.example.com"), ("127.0.0.1", "127.0.0.1")])
def test_canonical_address_drops_the_root_dot(given, stored):
    assert canonical_address(given) == stored


def test_a_trailing_dot_is_the_same_address_for_the_409(api):
    assert api.post(URL, valid_payload(address="localhost"), format="json").status_code == 201
    r = api.post(URL, valid_payload(address="LocalHost.", name="again"), format="json")
    assert r.status_code == 409, (r.status_code, r.content[:300])
    assert "already registered at localhost:2222" in r.json()["detail"]
    assert list(Node.objects.values_list("address", flat=True)) == ["localhost"]


def test_a_name_with_its_root_dot_is_stored_without_it(api, user):
    r = api.post(URL, valid_payload(address="LocalHost."), format="json")
    assert r.status_code == 201, r.content
    assert r.json()["address"] == "localhost"
    web = logged_in(user)
    r = web.post(PAGE, {**FORM, "address": "localhost.", "ssh_port": "2223"})
    assert r.status_code == 302, r.content.decode()[:1000]
    assert sorted(Node.objects.values_list("address", flat=True)) == ["localhost", "localhost"]
