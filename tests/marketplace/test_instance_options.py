"""Instance options through the API (issue 12): the renter's own image and registry login, env, onstart, ports,
minimum CUDA version; every bad input a 400 (or 409) naming the field with nothing written; the registry password
encrypted at rest, never answered nor logged, gone once the instance ends; the agent's request built from them;
the logs endpoint's input and ownership."""
import json
import logging

import pytest
from django.db import connection

from core.errors import ValidationFailed
from core.idempotency import request_fingerprint
from marketplace.encryption import decrypt_secret
from marketplace.models import Instance, Node
from marketplace.services import instances as svc
from marketplace.services.instances import options as opts
from provisioning.agent.gpumarket_agent import AgentError
from provisioning.agent.gpumarket_agent import options as agent_options
from provisioning.services.vms import create_request
from tests.factories import UserFactory, make_listed_node

from .renting_helpers import ed25519_key, run, sent_jobs_fixture, snapshot  # noqa: F401

pytestmark = pytest.mark.django_db

URL = "/api/v1/instances/"
PASSWORD = "s3cret-Registry-Token-7f1d"  # noqa: S105 (a test value, looked for everywhere it must not be)
DIGEST = "sha256:" + "ab" * 32


def body(node, **overrides):
    data = {"offer": node.pk, "num_gpus": 1, "image": "pytorch-2-5", "ssh_public_key": ed25519_key("me@laptop")}
    data.update(overrides)
    return data


def post(client, data, **headers):
    return client.post(URL, data, format="json", **headers)


def with_cuda(node: Node, version) -> Node:
    Node.objects.filter(pk=node.pk).update(inventory={**node.inventory, "cuda_version": version})
    return Node.objects.get(pk=node.pk)


# ------------------------------------------------------------------------------------ bad input

BAD = [
    # image references that break the distribution/reference grammar
    ({"image": "Ubuntu:24.04"}, "image"),  # upper case in the path
    ({"image": "registry.example.com//app:1"}, "image"),
    ({"image": "app:"}, "image"),
    ({"image": "app:bad tag"}, "image"),
    ({"image": ":1.0"}, "image"),
    ({"image": "app@sha256:abc"}, "image"),  # a digest of 64 hex digits
    ({"image": "app@md5:" + "a" * 32}, "image"),
    ({"image": "team/-app:1"}, "image"),
    ({"image": "app:" + "t" * 129}, "image"),  # a tag has at most 128 characters
    ({"image": "r.io/" + "a" * 251 + ":1"}, "image"),  # the name has at most 255 characters
    ({"image": "a" * 513}, "image"),
    ({"image": "app;rm -rf /:1"}, "image"),
    ({"image": "app:1\n"}, "image"),
    ({"image": "no-such-slug"}, "image"),  # a bare word is a catalogue slug
    ({"image": 5}, "image"),
    # registry login
    ({"image": "r.example.com/app:1", "registry_auth": "user:pass"}, "registry_auth"),
    ({"image": "r.example.com/app:1", "registry_auth": {"username": "u"}}, "registry_auth"),
    ({"image": "r.example.com/app:1", "registry_auth": {"username": "", "password": "p"}}, "registry_auth"),
    ({"image": "r.example.com/app:1", "registry_auth": {"username": "u", "password": "p", "email": "e"}},
     "registry_auth"),
    ({"image": "r.example.com/app:1", "registry_auth": {"username": "u", "password": "p" * 4097}}, "registry_auth"),
    ({"image": "r.example.com/app:1", "registry_auth": {"username": "u\n", "password": "p"}}, "registry_auth"),
    ({"image": "r.example.com/app:1", "registry_auth": {"username": "u", "password": 5}}, "registry_auth"),
    ({"image": "r.example.com/app:1", "registry_auth": {"username": "robot:ci", "password": "p"}}, "registry_auth"),
    ({"registry_auth": {"username": "u", "password": "p"}}, "registry_auth"),  # a catalogue image needs none
    # env
    ({"env": ["A=1"]}, "env"),
    ({"env": {"lower": "x"}}, "env"),
    ({"env": {"1ABC": "x"}}, "env"),
    ({"env": {"A-B": "x"}}, "env"),
    ({"env": {"": "x"}}, "env"),
    ({"env": {"A" * 129: "x"}}, "env"),
    ({"env": {"A": 1}}, "env"),
    ({"env": {"A": None}}, "env"),
    ({"env": {"A": "x" * 4097}}, "env"),
    ({"env": {"A": "a\x00b"}}, "env"),
    ({"env": {f"V{i}": "x" for i in range(65)}}, "env"),
    ({"env": {f"V{i}": "x" * 4000 for i in range(9)}}, "env"),  # 36 kB in all
    ({"env": {f"V{i:02d}": "x" * 509 for i in range(64)}}, "env"),  # 32768 bytes + 64 '=' (NAME=value)
    ({"env": {"PEM": "-----BEGIN KEY-----\nabc\n-----END KEY-----"}}, "env"),
    ({"env": {"A": "a\rb"}}, "env"),
    ({"env": {"NVIDIA_VISIBLE_DEVICES": "all"}}, "env"),
    ({"env": {"NVIDIA_DRIVER_CAPABILITIES": "all"}}, "env"),
    ({"env": None}, "env"),
    # onstart
    ({"onstart": "x" * 16385}, "onstart"),
    ({"onstart": "echo\x00"}, "onstart"),
    ({"onstart": ["echo", "hi"]}, "onstart"),
    # ports
    ({"ports": [0]}, "ports"),
    ({"ports": [65536]}, "ports"),
    ({"ports": [-1]}, "ports"),
    ({"ports": [22]}, "ports"),
    ({"ports": [8888, 8888]}, "ports"),
    ({"ports": ["8888"]}, "ports"),
    ({"ports": [True]}, "ports"),
    ({"ports": [80.5]}, "ports"),
    ({"ports": 8888}, "ports"),
    ({"ports": list(range(8000, 8017))}, "ports"),
    # minimum CUDA version
    ({"min_cuda_version": "12"}, "min_cuda_version"),
    ({"min_cuda_version": "12.2.1"}, "min_cuda_version"),
    ({"min_cuda_version": "twelve"}, "min_cuda_version"),
    ({"min_cuda_version": 12.2}, "min_cuda_version"),
    ({"min_cuda_version": "012.2"}, "min_cuda_version"),
]


@pytest.mark.parametrize(("overrides", "field"), BAD)
def test_bad_option_is_400_naming_the_field_and_changes_nothing(api, overrides, field):
    node = make_listed_node(gpu_count=4)
    before = snapshot()
    r = post(api, body(node, **overrides))
    assert r.status_code == 400, r.content
    assert field in r.json(), r.json()
    assert snapshot() == before
    assert PASSWORD not in r.content.decode()


def test_the_limits_themselves_are_accepted(api):
    node = with_cuda(make_listed_node(gpu_count=4), "12.4")
    env = {f"V{i}": "x" * 500 for i in range(63)} | {"A" * 128: ""}
    r = post(api, body(node, env=env, onstart="e" * 16384, ports=[1, *range(23, 38)], min_cuda_version="0.0"))
    assert r.status_code == 201, r.content
    got = r.json()
    assert got["env"] == dict.fromkeys(env, svc.ENV_VALUE_MASK)
    assert len(got["onstart"]) == 16384 and len(got["ports_requested"]) == 16
    assert svc.instance_env(instance=Instance.objects.get(pk=got["id"])) == env


@pytest.mark.parametrize("reference", [
    "ubuntu:24.04", "library/ubuntu", "docker.io/library/ubuntu:24.04", "ghcr.io/org/team/app:v1.2_rc-3",
    "registry.example.com:443/app", "registry.example.com:5000/a.b/c__d/e--f:latest", f"app@{DIGEST}",
    f"r.example.com/app:1@{DIGEST}", "Registry.Example.com/app:1",
])
def test_any_oci_reference_is_an_image_of_ones_own(api, reference):
    node = make_listed_node(gpu_count=4)
    r = post(api, body(node, image=reference))
    assert r.status_code == 201, r.content
    assert r.json()["image"] == reference and r.json()["registry_auth"] is False
    instance = Instance.objects.get(pk=r.json()["id"])
    assert instance.image is None and instance.image_ref == reference
    assert create_request(instance)["image"] == {"docker": reference}


def test_ones_own_image_is_refused_on_a_libvirt_node(api):
    node = make_listed_node(gpu_count=4, runtime="libvirt")
    before = snapshot()
    r = post(api, body(node, image="ghcr.io/org/app:1", disk_gb=40))
    assert r.status_code == 400 and "image" in r.json(), r.content
    assert snapshot() == before


def test_min_cuda_version_refuses_an_older_driver_and_an_unknown_one_naming_the_field(api):
    node = with_cuda(make_listed_node(gpu_count=4), "12.4")
    before = snapshot()
    r = post(api, body(node, min_cuda_version="12.8"))
    assert r.status_code == 400 and "min_cuda_version" in r.json(), r.content
    assert "12.4" in r.json()["min_cuda_version"][0]
    r = post(api, body(node, min_cuda_version="12.10"))  # compared as numbers: 12.10 > 12.4
    assert r.status_code == 400, r.content
    unknown = with_cuda(make_listed_node(gpu_count=1), None)
    before = snapshot()
    r = post(api, body(unknown, min_cuda_version="11.0"))
    assert r.status_code == 400 and "min_cuda_version" in r.json(), r.content
    assert snapshot() == before
    for fits in ("12.4", "12.2", "11.8"):
        r = post(api, body(node, min_cuda_version=fits))
        assert r.status_code == 201, (fits, r.content)
        assert r.json()["min_cuda_version"] == fits


@pytest.mark.parametrize(("overrides", "words"), [
    ({"env": {"NVIDIA_VISIBLE_DEVICES": "all"}},
     "NVIDIA_VISIBLE_DEVICES is reserved: names starting with NVIDIA_ steer the server's GPU container runtime"),
    ({"env": {"PEM": "-----BEGIN KEY-----\nabc\n-----END KEY-----"}},
     "The value of PEM is one line (no line breaks): encode a multi-line value, e.g. in base64"),
    ({"env": {f"V{i:02d}": "x" * 509 for i in range(64)}},
     "at most 32768 bytes in all (NAME=value for each variable, UTF-8); it has 32832"),
    ({"image": "r.example.com/app:1", "registry_auth": {"username": "robot:ci", "password": "p"}},
     "`registry_auth.username` may not hold ':'"),
])
def test_what_the_node_would_refuse_is_a_400_that_says_why(api, overrides, words):
    """Found by review: these were booked, then failed at `vm create` (the agent's invalid_request)."""
    node = make_listed_node(gpu_count=4)
    r = post(api, body(node, **overrides))
    assert r.status_code == 400, r.content
    (field,) = r.json()
    assert words in r.json()[field][0], r.json()


AGENT_CASES = [
    ({"A": "x"}, None), ({"A": ""}, None), ({"CUDA_VISIBLE_DEVICES": "0"}, None), ({"NVIDIA": "x"}, None),
    ({"NVIDIA_VISIBLE_DEVICES": "all"}, None), ({"NVIDIA_": "x"}, None), ({"A": "a\nb"}, None),
    ({"A": "a\rb"}, None), ({"A": "a\x00b"}, None), ({"A": "tab\there"}, None), ({"A": "žluťoučký 🐎"}, None),
    ({"A": "x" * 4096}, None), ({"A": "x" * 4097}, None), ({"A": "\ud800"}, None),
    ({f"V{i:02d}": "x" * 509 for i in range(64)}, None),  # 32832 bytes by the agent's count
    ({f"V{i:02d}": "x" * 508 for i in range(64)}, None),  # 32768
    ({f"V{i:02d}": "é" * 254 for i in range(64)}, None),  # 64 * (4 + 508) = 32768
    ({f"V{i:02d}": "é" * 255 for i in range(64)}, None),
    ({}, {"username": "robot", "password": "p"}), ({}, {"username": "robot:ci", "password": "p"}),
    ({}, {"username": "u" * 256, "password": "p"}), ({}, {"username": "u\x7f", "password": "p"}),
    ({}, {"username": "u", "password": "p\x00"}), ({}, {"username": "u", "password": "p" * 4097}),
    ({}, {"username": "u", "password": "\ud800"}),
]
# The platform refuses more here: control characters anywhere in a registry login, text that is not Unicode.
PLATFORM_STRICTER = [({}, {"username": "u", "password": "p\tq"}), ({}, {"username": "\ud800", "password": "p"})]


def _accepts(error, check_env, check_auth, env, auth) -> bool:
    try:
        check_env(env)
        check_auth(auth)
    except error:
        return False
    return True


@pytest.mark.parametrize(("env", "auth"), AGENT_CASES + PLATFORM_STRICTER)
def test_the_platform_accepts_only_what_the_nodes_agent_accepts(env, auth):
    """The limits are the node agent's (provisioning/agent/gpumarket_agent/options.py): what the platform accepts
    must not be refused at `vm create`, after the renter booked (found by review: multi-line values, the agent's
    '=' per variable, ':' in a registry user name, NVIDIA_ names)."""
    platform = _accepts(ValidationFailed, opts.clean_env, opts.clean_registry_auth, env, auth)
    agent = _accepts(AgentError, agent_options.validate_env, agent_options.validate_registry_auth, env, auth)
    assert not platform or agent
    assert platform == agent or (env, auth) in PLATFORM_STRICTER


# ------------------------------------------------------------------------ options reach the agent


def test_options_are_stored_shown_and_sent_to_the_agent_as_json(api):
    node = with_cuda(make_listed_node(gpu_count=4), "12.4")
    env = {"API_KEY": "k$(reboot)`id`;'\"", "EMPTY": "", "UNICODE": "žluťoučký 🐎"}
    onstart = "echo started > /tmp/onstart.txt\nexec python3 -m http.server 8888 &"
    r = post(api, body(node, image="registry.example.com/team/app:2", env=env, onstart=onstart, ports=[8888, 6006],
                       registry_auth={"username": "robot", "password": PASSWORD}, min_cuda_version="11.0"))
    assert r.status_code == 201, r.content
    got = r.json()
    assert got["image"] == "registry.example.com/team/app:2" and got["registry_auth"] is True
    assert got["env"] == {"API_KEY": "********", "EMPTY": "********", "UNICODE": "********"}
    assert got["onstart"] == onstart and got["ports_requested"] == [8888, 6006]
    assert got["ports"] == {} and got["os"] is None and got["min_cuda_version"] == "11.0"
    instance = Instance.objects.get(pk=got["id"])
    request = create_request(instance)
    assert request["env"] == env and request["onstart"] == onstart and request["ports"] == [8888, 6006]
    assert request["registry_auth"] == {"username": "robot", "password": PASSWORD}
    assert request["image"] == {"docker": "registry.example.com/team/app:2"}
    assert json.loads(json.dumps(request)) == request  # plain JSON, nothing else
    # A catalogue image without options sends none of them.
    plain = Instance.objects.get(pk=post(api, body(node)).json()["id"])
    assert not {"env", "onstart", "ports", "registry_auth"} & set(create_request(plain))


def test_the_agents_answer_gives_the_instance_its_ports_and_os_but_never_another_disk_size(api, caplog):
    """The disk stays the size the renter booked (and pays for while stopped): the node's (the provider's) report of
    another size is logged, never recorded (before, it replaced the booked size, and billing followed it)."""
    node = make_listed_node(gpu_count=4)
    instance = Instance.objects.get(pk=post(api, body(node, ports=[8888])).json()["id"])
    booked = instance.disk_gb
    svc.instance_mark_provisioning(instance_id=instance.pk)
    svc.instance_mark_running(instance_id=instance.pk, ssh_host="203.0.113.7", ssh_port=40001, ssh_user="root", vm={
        "ports": {"8888/tcp": {"host": "203.0.113.7", "port": 40123}}, "os": "Debian GNU/Linux 13 (trixie)",
        "disk_gb": 60000})
    got = api.get(f"{URL}{instance.pk}/").json()
    assert got["ports"] == {"8888/tcp": {"host": "203.0.113.7", "port": 40123}}
    assert got["os"] == "Debian GNU/Linux 13 (trixie)" and got["disk_gb"] == booked
    assert f"reports a 60000 GB disk; {booked} GB were booked" in caplog.text
    # An answer with something malformed in it records none of that part.
    svc.instance_mark_running(instance_id=instance.pk, ssh_host="203.0.113.7", ssh_port=40001, ssh_user="root",
                              vm={"ports": {"8888/tcp": {"host": 1, "port": "x"}}, "os": 5, "disk_gb": True})
    again = api.get(f"{URL}{instance.pk}/").json()
    assert again["ports"] == got["ports"] and again["os"] == got["os"] and again["disk_gb"] == booked


# ---------------------------------------------------------------------- the registry password


def _raw_column(instance_id: int, column: str = "registry_auth_encrypted") -> bytes | None:
    query = {"registry_auth_encrypted": "SELECT registry_auth_encrypted FROM marketplace_instance WHERE id = %s",
             "env_encrypted": "SELECT env_encrypted FROM marketplace_instance WHERE id = %s"}[column]
    with connection.cursor() as cursor:
        cursor.execute(query, [instance_id])
        value = cursor.fetchone()[0]
    return None if value is None else bytes(value)


def test_registry_password_is_encrypted_at_rest_never_answered_nor_logged_and_gone_at_the_end(api, caplog):
    caplog.set_level(logging.DEBUG)
    node = make_listed_node(gpu_count=4)
    data = body(node, image="registry.example.com/team/app:2",
                registry_auth={"username": "robot", "password": PASSWORD})
    r = post(api, data, HTTP_IDEMPOTENCY_KEY="k-1")
    assert r.status_code == 201, r.content
    instance_id = r.json()["id"]
    raw = _raw_column(instance_id)
    assert raw and PASSWORD.encode() not in raw and b"robot" not in raw
    assert json.loads(decrypt_secret(raw)) == {"username": "robot", "password": PASSWORD}
    # Not in any answer, not in the stored fingerprint (no plain hash of it either), not in any log line.
    answers = [r, api.get(f"{URL}{instance_id}/"), api.get(URL),
               post(api, data, HTTP_IDEMPOTENCY_KEY="k-1")]
    for answer in answers:
        assert answer.status_code == 200 or answer.status_code == 201
        assert PASSWORD not in answer.content.decode() and "robot" not in answer.content.decode()
    assert answers[-1].json()["id"] == instance_id  # the retry found it
    instance = Instance.objects.get(pk=instance_id)
    assert instance.request_fingerprint and instance.request_fingerprint != request_fingerprint(data)
    row = Instance.objects.filter(pk=instance_id).values().get()
    assert PASSWORD not in json.dumps(row, default=lambda v: repr(v) if not isinstance(v, memoryview | bytes)
                                      else "<bytes>")
    assert all(PASSWORD not in record.getMessage() for record in caplog.records)
    assert PASSWORD not in repr(opts.instance_options(registry_auth={"username": "u", "password": PASSWORD}))
    # A failed instance pulls nothing again: the password goes, the flag stays.
    svc.instance_mark_failed(instance_id=instance_id, message="The image could not be pulled: unauthorized")
    assert _raw_column(instance_id) is None
    assert api.get(f"{URL}{instance_id}/").json()["registry_auth"] is True


def test_registry_password_goes_when_the_instance_is_destroyed(api):
    node = make_listed_node(gpu_count=4)
    r = post(api, body(node, image="r.example.com/app:1", registry_auth={"username": "u", "password": PASSWORD}))
    instance = run(Instance.objects.get(pk=r.json()["id"]))
    assert _raw_column(instance.pk) is not None
    svc.instance_destroy(instance=instance)
    assert _raw_column(instance.pk) is not None  # still destroying
    svc.instance_mark_destroyed(instance_id=instance.pk)
    assert _raw_column(instance.pk) is None


def test_a_failed_pull_bills_nothing(api, user):
    """The pull failed on the node: the instance ends failed with the registry's reason, never ran, costs 0."""
    from billing.models import Entry, UsageInterval

    node = make_listed_node(gpu_count=4)
    r = post(api, body(node, image="r.example.com/app:1"))
    instance_id = r.json()["id"]
    svc.instance_mark_provisioning(instance_id=instance_id)
    entries = Entry.objects.count()
    svc.instance_mark_failed(instance_id=instance_id, message="The image could not be pulled: manifest unknown")
    got = api.get(f"{URL}{instance_id}/").json()
    assert got["status"] == "failed" and "manifest unknown" in got["status_message"]
    assert got["cost_so_far"] == "0.000000" or float(got["cost_so_far"]) == 0
    assert Entry.objects.count() == entries and not UsageInterval.objects.filter(instance_id=instance_id).exists()


# ---------------------------------------------------------------------------------- logs: input


@pytest.mark.parametrize("tail", ["0", "5001", "-1", "1.5", "abc", "99999999999999999999", "１０", "+5"])
def test_logs_tail_out_of_range_is_400_naming_tail(api, tail):
    node = make_listed_node(gpu_count=4)
    instance = run(Instance.objects.get(pk=post(api, body(node)).json()["id"]))
    r = api.get(f"{URL}{instance.pk}/logs/", {"tail": tail})
    assert r.status_code == 400 and "tail" in r.json(), r.content


def test_logs_unknown_parameter_is_400_and_another_users_instance_is_404(api, other_api):
    node = make_listed_node(gpu_count=4)
    instance = run(Instance.objects.get(pk=post(api, body(node)).json()["id"]))
    r = api.get(f"{URL}{instance.pk}/logs/", {"lines": "5"})
    assert r.status_code == 400 and "lines" in r.json()
    assert other_api.get(f"{URL}{instance.pk}/logs/").status_code == 404
    assert other_api.get(f"{URL}{instance.pk}/logs/", {"tail": "0"}).status_code == 404


def test_logs_of_an_instance_without_a_vm_is_409_and_an_unreachable_node_503(api):
    node = make_listed_node(gpu_count=4)  # 10.0.0.1 at an unused port: nothing answers
    requested = Instance.objects.get(pk=post(api, body(node)).json()["id"])
    r = api.get(f"{URL}{requested.pk}/logs/")
    assert r.status_code == 409, r.content
    running = run(requested, host="127.0.0.1")
    Node.objects.filter(pk=node.pk).update(address="127.0.0.1", ssh_port=1)
    r = api.get(f"{URL}{running.pk}/logs/", {"tail": "10"})
    assert r.status_code == 503, r.content
    assert "did not answer" in r.json()["detail"]


# ------------------------------------------------------------------------------ the env's values

API_KEY = "sk-live-4f1c9e27b8d3a6e0"


def test_env_values_are_encrypted_at_rest_answered_masked_never_logged_and_gone_at_the_end(api, user, client,
                                                                                          caplog):
    caplog.set_level(logging.DEBUG)
    node = make_listed_node(gpu_count=4)
    env = {"HF_TOKEN": API_KEY, "MODE": "train"}
    data = body(node, image="registry.example.com/team/app:2", env=env)
    r = post(api, data, HTTP_IDEMPOTENCY_KEY="env-1")
    assert r.status_code == 201, r.content
    instance_id = r.json()["id"]
    # The column holds a Fernet token, not the values; the names are kept apart, in the renter's order.
    raw = _raw_column(instance_id, "env_encrypted")
    assert raw and API_KEY.encode() not in raw and b"train" not in raw
    assert json.loads(decrypt_secret(raw)) == env
    with connection.cursor() as cursor:
        cursor.execute("SELECT env_names FROM marketplace_instance WHERE id = %s", [instance_id])
        assert json.loads(cursor.fetchone()[0]) == ["HF_TOKEN", "MODE"]
    row = Instance.objects.filter(pk=instance_id).values().get()
    assert API_KEY not in json.dumps(row, default=lambda v: "<bytes>" if isinstance(v, memoryview | bytes)
                                     else repr(v))
    # Names only, every value masked, in every answer: create, detail, list, an idempotent retry, the page.
    answers = [r, api.get(f"{URL}{instance_id}/"), api.get(URL), post(api, data, HTTP_IDEMPOTENCY_KEY="env-1")]
    for answer in answers:
        assert answer.status_code in (200, 201) and API_KEY not in answer.content.decode()
    assert answers[1].json()["env"] == {"HF_TOKEN": "********", "MODE": "********"}
    assert answers[-1].json()["id"] == instance_id
    # The double-booking fingerprint holds no plain hash of the env (a keyed one, as for the registry password).
    assert Instance.objects.get(pk=instance_id).request_fingerprint != request_fingerprint(data)
    client.force_login(user)
    page = client.get(f"/instances/{instance_id}/")
    assert page.status_code == 200 and "HF_TOKEN" in page.content.decode() and API_KEY not in page.content.decode()
    client.force_login(UserFactory(is_staff=True, is_superuser=True))  # operators see the names, no value
    admin = client.get(f"/admin/marketplace/instance/{instance_id}/change/")
    assert admin.status_code == 200 and "HF_TOKEN" in admin.content.decode()
    assert API_KEY not in admin.content.decode()
    # The node gets the values, decrypted for its request only; no log line carries them.
    assert create_request(Instance.objects.get(pk=instance_id))["env"] == env
    assert all(API_KEY not in record.getMessage() for record in caplog.records)
    assert API_KEY not in repr(opts.instance_options(env=env))
    # A failed instance creates nothing again: the values go, the names stay.
    svc.instance_mark_failed(instance_id=instance_id, message="The image could not be pulled: unauthorized")
    assert _raw_column(instance_id, "env_encrypted") is None
    assert api.get(f"{URL}{instance_id}/").json()["env"] == {"HF_TOKEN": "********", "MODE": "********"}


def test_env_values_go_when_the_instance_is_destroyed_and_no_env_stores_nothing(api):
    node = make_listed_node(gpu_count=4)
    instance = run(Instance.objects.get(pk=post(api, body(node, env={"A": API_KEY})).json()["id"]))
    svc.instance_destroy(instance=instance)
    assert _raw_column(instance.pk, "env_encrypted") is not None  # still destroying
    svc.instance_mark_destroyed(instance_id=instance.pk)
    assert _raw_column(instance.pk, "env_encrypted") is None
    plain = post(api, body(node)).json()
    assert plain["env"] == {} and _raw_column(plain["id"], "env_encrypted") is None
