"""Instances through the API: booking, bad input without state change, idempotency, ownership, lifecycle."""
from decimal import Decimal

import pytest

from marketplace.models import Gpu, GpuAllocation, GpuStatus, Image, Instance, NodeState, SshKey, Verdict
from marketplace.services import instances as svc
from marketplace.services.nodes import node_update
from provisioning.models import Job, JobKind
from tests.factories import UserFactory, make_listed_node, make_node

from .renting_helpers import add_key, book, ed25519_key, gpu_indices, run, sent_jobs_fixture, snapshot  # noqa: F401

pytestmark = pytest.mark.django_db

URL = "/api/v1/instances/"


def body(node, **overrides):
    data = {"offer": node.pk, "num_gpus": 1, "image": "pytorch-2-5", "ssh_public_key": ed25519_key("me@laptop")}
    data.update(overrides)
    return data


def post(client, data, key=None):
    headers = {"HTTP_IDEMPOTENCY_KEY": key} if key is not None else {}
    return client.post(URL, data, format="json", **headers)


def gpu_statuses(node) -> list[str]:
    return list(Gpu.objects.filter(node=node).order_by("index").values_list("status", flat=True))


# ------------------------------------------------------------------------------------ booking


def test_create_books_gpus_snapshots_the_price_and_queues_provisioning(api, user):
    node = make_listed_node(gpu_count=4, price="1.250000")
    key = add_key(user, "laptop")
    r = post(api, body(node, num_gpus=2, ssh_keys=[key.pk], label="train-1", disk_gb=100))
    assert r.status_code == 201, r.content
    inst = r.json()
    assert inst["status"] == "requested" and inst["status_message"] == "Waiting for a worker"
    assert inst["node"] == node.pk and inst["gpu_model"] == "a100-80gb-sxm"
    assert inst["num_gpus"] == 2 and inst["gpus"] == [0, 1]
    assert inst["image"] == "pytorch-2-5" and inst["label"] == "train-1" and inst["disk_gb"] == 100
    assert inst["price_per_gpu_hour"] == "1.250000" and inst["price_per_hour"] == "2.500000"
    assert inst["ssh_command"] is None and inst["ssh_host"] is None and inst["ssh_port"] is None
    assert len(inst["ssh_public_keys"]) == 2 and inst["ssh_public_keys"][0] == key.public_key
    assert all(k.count(" ") == 1 for k in inst["ssh_public_keys"])  # normalised, no comment
    assert gpu_statuses(node) == ["rented", "rented", "free", "free"]
    assert GpuAllocation.objects.filter(instance_id=inst["id"], released_at__isnull=True).count() == 2
    job = Job.objects.get(instance_id=inst["id"])
    assert job.kind == JobKind.INSTANCE_PROVISION and job.node_id == node.pk
    # The price is a snapshot: the provider's later change does not reach it.
    node_update(node=node, price_per_gpu_hour=Decimal("9"))
    assert api.get(f"{URL}{inst['id']}/").json()["price_per_hour"] == "2.500000"


def test_jobs_go_to_celery_only_on_commit(api, sent_jobs, django_capture_on_commit_callbacks):
    node = make_listed_node()
    with django_capture_on_commit_callbacks(execute=True):
        inst = post(api, body(node)).json()
        assert sent_jobs == []
    assert sent_jobs == [(Job.objects.get(instance_id=inst["id"]).pk, "instance_provision")]
    with django_capture_on_commit_callbacks(execute=True):
        assert post(api, body(node, num_gpus=4)).status_code == 409
    assert len(sent_jobs) == 1  # a refused booking queues nothing


def test_disk_defaults_to_the_images_minimum(api):
    node = make_listed_node()
    r = post(api, body(node, image="cuda-12-4"))
    assert r.status_code == 201 and r.json()["disk_gb"] == Image.objects.get(slug="cuda-12-4").min_disk_gb


def test_the_same_key_twice_is_put_on_once(api, user):
    node = make_listed_node()
    key = add_key(user)
    r = post(api, body(node, ssh_keys=[key.pk], ssh_public_key=key.public_key + " dup"))
    assert r.status_code == 201 and r.json()["ssh_public_keys"] == [key.public_key]


def test_saved_and_pasted_keys_together_past_the_agents_limit_are_refused_before_anything_is_written(api, user):
    # 32 saved keys (the most an account keeps) and one pasted: the agent takes at most 32, so the booking is a
    # 400 here and not a job that can only fail on the node.
    node = make_listed_node()
    keys = [add_key(user).pk for _ in range(32)]
    r = post(api, body(node, ssh_keys=keys))
    assert r.status_code == 400 and "At most 32 SSH keys" in r.json()["ssh_keys"][0], r.content
    assert not Instance.objects.exists() and not Job.objects.exists()
    assert set(gpu_statuses(node)) == {"free"}
    assert post(api, body(node, ssh_keys=keys[:31])).status_code == 201  # 31 and the pasted one: 32


@pytest.mark.parametrize("keys, words", [({}, 'Expected a list of items but got type "dict".'),
                                          ("1", 'Expected a list of items but got type "str".'),
                                          ([None], "An SSH key id may not be null.")])
def test_ssh_keys_is_a_list_of_ids(api, user, keys, words):
    """`{}` was read as `[]` (a 201 beside a pasted key) and `[null]` answered 'Invalid pk "None"'."""
    node = make_listed_node()
    r = post(api, body(node, ssh_keys=keys, ssh_public_key=ed25519_key()))
    assert r.status_code == 400 and r.json()["ssh_keys"] == [words], r.content
    assert not Instance.objects.exists() and not Job.objects.exists()


def test_an_account_keeps_at_most_32_saved_keys(api, user):
    for _ in range(32):
        add_key(user)
    r = api.post("/api/v1/ssh-keys/", {"public_key": ed25519_key()}, format="json")
    assert r.status_code == 409 and "32 saved SSH keys" in r.json()["detail"]
    assert SshKey.objects.filter(user=user).count() == 32


def test_offers_show_fewer_free_gpus_after_booking(api, anon):
    node = make_listed_node(gpu_count=2)
    post(api, body(node))
    offer = anon.get("/api/v1/offers/").json()["results"][0]
    assert offer["id"] == node.pk and offer["num_gpus_free"] == 1


# ------------------------------------------------------------------------------- bad input


def _unlisted():
    return make_listed_node(listed=False)


def _maintenance():
    return make_node(state=NodeState.MAINTENANCE, verdict=Verdict.VERIFIED)


def _unverified():
    return make_node()


def _rejected():
    return make_node(state=NodeState.REJECTED, verdict=Verdict.REJECTED)


@pytest.mark.parametrize(("make", "words"), [
    (_unlisted, "unlisted"), (_maintenance, "maintenance"), (_unverified, "not been verified"),
    (_rejected, "did not pass"),
])
def test_offer_not_available_is_409_with_the_reason(api, make, words):
    node = make()
    before = snapshot()
    r = post(api, body(node))
    assert r.status_code == 409 and "not available" in r.json()["detail"] and words in r.json()["detail"]
    assert snapshot() == before


def test_unknown_offer_is_400_naming_offer(api):
    node = make_listed_node()
    before = snapshot()
    r = post(api, body(node, offer=999_999_999))
    assert r.status_code == 400 and "no offer" in r.json()["offer"][0].lower()
    assert snapshot() == before


def test_not_enough_free_gpus_is_409_saying_so(api, other_api):
    node = make_listed_node(gpu_count=2)
    assert post(other_api, body(node)).status_code == 201
    before = snapshot()
    r = post(api, body(node, num_gpus=2))
    assert r.status_code == 409
    assert r.json()["detail"] == "Only 1 GPU is free on this node now; you asked for 2."
    assert snapshot() == before
    assert post(other_api, body(node)).status_code == 201
    r = post(api, body(node))
    assert r.status_code == 409 and r.json()["detail"].startswith("No GPU is free on this node now")


def test_unavailable_gpus_are_not_booked(api):
    node = make_listed_node(gpu_count=2)
    Gpu.objects.filter(node=node, index=0).update(status=GpuStatus.UNAVAILABLE)
    r = post(api, body(node))
    assert r.status_code == 201 and r.json()["gpus"] == [1]
    assert post(api, body(node)).status_code == 409


@pytest.mark.parametrize(("overrides", "field"), [
    ({"num_gpus": 0}, "num_gpus"),
    ({"num_gpus": 5}, "num_gpus"),  # the node has 4
    ({"num_gpus": 65}, "num_gpus"),
    ({"num_gpus": -1}, "num_gpus"),
    ({"num_gpus": "2"}, "num_gpus"),
    ({"num_gpus": True}, "num_gpus"),
    ({"offer": 0}, "offer"),
    ({"offer": "abc"}, "offer"),
    ({"image": "windows-95"}, "image"),
    ({"image": None}, "image"),
    ({"disk_gb": 10}, "disk_gb"),  # below the image's minimum
    ({"disk_gb": 2001}, "disk_gb"),
    ({"label": "x" * 101}, "label"),
    ({"label": "bad\nlabel"}, "label"),
    ({"ssh_public_key": "ssh-dss AAAAB3NzaC1kc3MAAACBAP"}, "ssh_public_key"),
    ({"ssh_public_key": 'command="sh" ' + ed25519_key()}, "ssh_public_key"),
    ({"ssh_public_key": ed25519_key() + "\n" + ed25519_key()}, "ssh_public_key"),
    ({"ssh_public_key": None}, "ssh_public_key"),
    ({"ssh_keys": [999_999]}, "ssh_keys"),
    ({"ssh_keys": "1"}, "ssh_keys"),
    ({"ssh_keys": ["x"]}, "ssh_keys"),
    ({"ssh_keys": [10**20]}, "ssh_keys"),
    ({"ssh_keys": [True]}, "ssh_keys"),
    ({"offer": 2**63}, "offer"),
    ({"gpus": [0]}, "gpus"),  # unknown field
    ({"status": "running"}, "status"),  # read-only field
])
def test_bad_input_is_400_naming_the_field_and_changes_nothing(api, overrides, field):
    node = make_listed_node(gpu_count=4)
    before = snapshot()
    r = post(api, body(node, **overrides))
    assert r.status_code == 400, r.content
    assert field in r.json(), r.json()
    assert snapshot() == before


def test_a_key_is_required(api):
    node = make_listed_node()
    data = body(node)
    del data["ssh_public_key"]
    before = snapshot()
    for extra in ({}, {"ssh_keys": []}):
        r = post(api, {**data, **extra})
        assert r.status_code == 400 and "at least one ssh key" in r.json()["ssh_keys"][0].lower()
    assert snapshot() == before


def test_another_users_key_id_is_refused(api, user):
    node = make_listed_node()
    theirs = add_key(UserFactory())
    before = snapshot()
    r = post(api, body(node, ssh_keys=[theirs.pk]))
    assert r.status_code == 400 and "ssh_keys" in r.json()
    assert snapshot() == before


@pytest.mark.parametrize(("runtime", "image_fields"), [
    ("docker", {"docker_image": "", "libvirt_image": "ubuntu-22.04-x"}),
    ("libvirt", {"docker_image": "gpumarket/x:1", "libvirt_image": ""}),
])
def test_image_the_runtime_cannot_run_is_400(api, runtime, image_fields):
    node = make_listed_node(runtime=runtime)
    Image.objects.create(slug="only-one", name="Only one", min_disk_gb=20, **image_fields)
    before = snapshot()
    r = post(api, body(node, image="only-one"))
    assert r.status_code == 400 and f"runtime is {runtime}" in r.json()["image"][0]
    assert snapshot() == before
    assert post(api, body(node, image="pytorch-2-5")).status_code == 201  # the seeded ones run anywhere


def test_anonymous_is_401(anon):
    node = make_listed_node()
    assert post(anon, body(node)).status_code == 401
    assert anon.get(URL).status_code == 401
    assert Instance.objects.count() == 0


# ----------------------------------------------------------------------------- idempotency


def test_same_key_same_body_returns_the_same_instance(api, sent_jobs):
    node = make_listed_node(gpu_count=4)
    data = body(node)
    first = post(api, data, key="order-42")
    again = post(api, data, key="order-42")
    assert first.status_code == 201 and again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    assert Instance.objects.count() == 1 and Job.objects.count() == 1
    assert gpu_statuses(node).count("rented") == 1
    inst = Instance.objects.get()
    assert inst.idempotency_key == "order-42" and len(inst.request_fingerprint) == 64
    # Key order does not matter: the body is canonicalised before hashing.
    assert post(api, dict(reversed(list(data.items()))), key="order-42").status_code == 200


def test_same_key_other_body_is_422_and_changes_nothing(api):
    node = make_listed_node(gpu_count=4)
    data = body(node)
    assert post(api, data, key="k1").status_code == 201
    before = snapshot()
    r = post(api, {**data, "num_gpus": 2}, key="k1")
    assert r.status_code == 422 and "different request" in r.json()["detail"]
    assert snapshot() == before


def test_replay_works_even_when_the_input_would_not_validate_now(api, user):
    node = make_listed_node()
    key = add_key(user)
    data = body(node, ssh_keys=[key.pk])
    first = post(api, data, key="k2").json()
    key.delete()
    node_update(node=node, listed=False)
    r = post(api, data, key="k2")
    assert r.status_code == 200 and r.json()["id"] == first["id"]


def test_idempotency_keys_are_per_user(api, other_api):
    node = make_listed_node(gpu_count=4)
    data = body(node)
    a = post(api, data, key="same").json()
    b = post(other_api, data, key="same")
    assert b.status_code == 201 and b.json()["id"] != a["id"]


def test_without_a_key_each_request_books_again(api):
    node = make_listed_node(gpu_count=4)
    assert post(api, body(node)).json()["id"] != post(api, body(node)).json()["id"]


@pytest.mark.parametrize("key", ["", "a" * 101, "tab\tkey", "é"])
def test_malformed_idempotency_key(api, key):
    node = make_listed_node()
    before = snapshot()
    r = post(api, body(node), key=key)
    assert r.status_code == 400 and "Idempotency-Key" in r.json()
    assert snapshot() == before


def test_a_refused_request_can_be_retried_with_the_same_key(api, other_api):
    node = make_listed_node(gpu_count=1)
    theirs = post(other_api, body(node)).json()
    assert post(api, body(node), key="retry").status_code == 409
    svc.instance_destroy(instance=Instance.objects.get(pk=theirs["id"]))
    svc.instance_mark_destroyed(instance_id=theirs["id"])
    assert post(api, body(node), key="retry").status_code == 201


# ------------------------------------------------------------------------------- ownership


def test_renters_see_only_their_own_instances(api, other_api, operator_api):
    node = make_listed_node(gpu_count=4)
    mine = post(api, body(node)).json()
    theirs = post(other_api, body(node)).json()
    assert [i["id"] for i in api.get(URL).json()["results"]] == [mine["id"]]
    assert api.get(f"{URL}{theirs['id']}/").status_code == 404
    assert operator_api.get(URL).json()["count"] == 0  # operators use the admin
    before = snapshot()
    for verb in ("stop", "start", "restart"):
        assert api.post(f"{URL}{theirs['id']}/{verb}/").status_code == 404
    assert api.delete(f"{URL}{theirs['id']}/").status_code == 404
    assert snapshot() == before


@pytest.mark.parametrize("path", ["abc/", "1.5/", "99999999999999999999999/"])
def test_malformed_ids_are_404(api, path):
    assert api.get(URL + path).status_code == 404
    assert api.post(URL + path + "stop/").status_code == 404


def test_provider_sees_rented_gpus_but_not_the_renter(api, user, client_for):
    provider = UserFactory()
    node = make_listed_node(provider, gpu_count=2)
    key = add_key(user, "secret-laptop")
    inst = post(api, body(node, ssh_keys=[key.pk], label="my-secret-label")).json()
    r = client_for(provider).get(f"/api/v1/nodes/{node.pk}/")
    assert r.status_code == 200
    assert [g["status"] for g in r.json()["gpus"]] == ["rented", "free"]
    text = r.content.decode()
    for secret in (user.email, key.public_key.split()[1], key.fingerprint, "my-secret-label", "renter"):
        assert secret not in text
    # and the provider cannot read the instance either
    assert client_for(provider).get(f"{URL}{inst['id']}/").status_code == 404


def test_list_filters_by_status(api):
    node = make_listed_node(gpu_count=4)
    a = post(api, body(node)).json()
    b = post(api, body(node)).json()
    run(Instance.objects.get(pk=b["id"]))
    assert [i["id"] for i in api.get(URL, {"status": "running"}).json()["results"]] == [b["id"]]
    got = api.get(f"{URL}?status=running&status=requested").json()["results"]
    assert {i["id"] for i in got} == {a["id"], b["id"]}
    assert api.get(URL, {"status": "bogus"}).status_code == 400
    assert api.get(URL, {"staus": "running"}).status_code == 400


# ------------------------------------------------------------------------------- lifecycle


def test_full_lifecycle_through_the_api(api, sent_jobs):
    node = make_listed_node(gpu_count=4)
    inst_id = post(api, body(node, num_gpus=2)).json()["id"]
    url = f"{URL}{inst_id}/"

    assert svc.instance_mark_provisioning(instance_id=inst_id).status == "provisioning"
    r = api.post(url + "stop/")
    assert r.status_code == 409 and "still being provisioned" in r.json()["detail"]
    svc.instance_mark_running(instance_id=inst_id, ssh_host="203.0.113.7", ssh_port=40022, ssh_user="root")
    got = api.get(url).json()
    assert got["status"] == "running" and got["ssh_command"] == "ssh -p 40022 root@203.0.113.7"
    assert got["started_at"] and got["stopped_at"] is None

    r = api.post(url + "stop/")
    assert r.status_code == 202 and r.json()["status"] == "stopping"
    assert api.post(url + "stop/").status_code == 202  # again: no second job
    assert Job.objects.filter(instance_id=inst_id, kind=JobKind.INSTANCE_STOP).count() == 1
    assert gpu_statuses(node) == ["rented", "rented", "free", "free"]  # held until the node confirms
    svc.instance_mark_stopped(instance_id=inst_id)
    got = api.get(url).json()
    assert got["status"] == "stopped" and got["gpus"] == [] and got["stopped_at"] and got["ssh_command"] is None
    assert gpu_statuses(node) == ["free"] * 4
    assert api.post(url + "stop/").json()["detail"] == "The instance is already stopped."
    assert api.post(url + "restart/").status_code == 409

    r = api.post(url + "start/")
    assert r.status_code == 202 and r.json()["status"] == "starting" and r.json()["gpus"] == [0, 1]
    assert Job.objects.filter(instance_id=inst_id, kind=JobKind.INSTANCE_START).count() == 1
    svc.instance_mark_running(instance_id=inst_id, ssh_host="203.0.113.7", ssh_port=40022, ssh_user="root")
    assert api.post(url + "start/").json()["detail"].startswith("The instance is already running")

    r = api.post(url + "restart/")
    assert r.status_code == 202 and r.json()["status"] == "starting" and r.json()["gpus"] == [0, 1]
    assert Job.objects.filter(instance_id=inst_id, kind=JobKind.INSTANCE_RESTART).count() == 1
    svc.instance_mark_running(instance_id=inst_id, ssh_host="203.0.113.7", ssh_port=40022, ssh_user="root")

    r = api.delete(url)
    assert r.status_code == 202 and r.json()["status"] == "destroying"
    assert api.delete(url).status_code == 202  # again while destroying: no second job
    assert Job.objects.filter(instance_id=inst_id, kind=JobKind.INSTANCE_DESTROY).count() == 1
    svc.instance_mark_destroyed(instance_id=inst_id)
    got = api.get(url).json()
    assert got["status"] == "destroyed" and got["destroyed_at"] and got["gpus"] == []
    assert gpu_statuses(node) == ["free"] * 4
    before = snapshot()
    r = api.delete(url)
    assert r.status_code == 409 and r.json()["detail"] == "The instance is already destroyed."
    for verb in ("stop", "start", "restart"):
        assert api.post(url + f"{verb}/").status_code == 409
    assert snapshot() == before


def test_stop_during_provisioning_is_409_and_changes_nothing(api):
    node = make_listed_node()
    inst_id = post(api, body(node)).json()["id"]
    for status_setter in (lambda: None, lambda: svc.instance_mark_provisioning(instance_id=inst_id)):
        status_setter()
        before = snapshot()
        r = api.post(f"{URL}{inst_id}/stop/")
        assert r.status_code == 409 and "still being provisioned" in r.json()["detail"]
        assert snapshot() == before


def test_destroy_while_requested_releases_gpus_once_destroyed(api):
    node = make_listed_node(gpu_count=1)
    inst_id = post(api, body(node)).json()["id"]
    assert api.delete(f"{URL}{inst_id}/").status_code == 202
    assert svc.instance_mark_provisioning(instance_id=inst_id) is None  # the provision task stands down
    svc.instance_mark_destroyed(instance_id=inst_id)
    assert gpu_statuses(node) == ["free"]


def _stopped_instance(renter, node, n=2):
    inst = run(book(renter, node, num_gpus=n))
    svc.instance_stop(instance=inst)
    return svc.instance_mark_stopped(instance_id=inst.pk)


def test_start_takes_the_same_gpus_back_when_free(api, user):
    node = make_listed_node(gpu_count=4)
    other = book(UserFactory(), node, num_gpus=1)  # GPU 0
    inst = _stopped_instance(user, node)  # GPUs 1, 2
    assert [a.gpu.index for a in inst.allocations.all()] == [1, 2]
    svc.instance_destroy(instance=other)
    svc.instance_mark_destroyed(instance_id=other.pk)  # GPU 0 is free again and comes first by index
    r = api.post(f"{URL}{inst.pk}/start/")
    assert r.status_code == 202 and r.json()["gpus"] == [1, 2]
    assert "GPUs 1, 2" in r.json()["status_message"]


def test_start_takes_other_gpus_of_the_node_when_its_own_are_taken(api, user):
    node = make_listed_node(gpu_count=4)
    inst = _stopped_instance(user, node)  # was on 0, 1
    book(UserFactory(), node, num_gpus=1)  # takes 0
    r = api.post(f"{URL}{inst.pk}/start/")
    assert r.status_code == 202 and r.json()["gpus"] == [1, 2]  # keeps 1, adds the lowest free one


def test_start_without_enough_free_gpus_is_409_and_changes_nothing(api, user):
    node = make_listed_node(gpu_count=2)
    inst = _stopped_instance(user, node, n=2)
    book(UserFactory(), node, num_gpus=1)
    before = snapshot()
    r = api.post(f"{URL}{inst.pk}/start/")
    assert r.status_code == 409
    assert r.json()["detail"] == ("Only 1 GPU of the 2 it needs are free on this node now; "
                                  "try again later, or destroy the instance.")
    assert snapshot() == before
    book(UserFactory(), node, num_gpus=1)
    r = api.post(f"{URL}{inst.pk}/start/")
    assert r.status_code == 409 and r.json()["detail"].startswith("No GPUs are free on this node now")


def test_start_on_a_node_in_maintenance_is_409(api, user):
    node = make_listed_node(gpu_count=2)
    inst = _stopped_instance(user, node, n=1)
    node_update(node=node, maintenance=True)
    before = snapshot()
    r = api.post(f"{URL}{inst.pk}/start/")
    assert r.status_code == 409 and "maintenance" in r.json()["detail"]
    assert snapshot() == before


def test_start_on_an_unlisted_node_still_works(api, user):
    node = make_listed_node(gpu_count=1)
    inst = _stopped_instance(user, node, n=1)
    node_update(node=node, listed=False)  # no new rentals, but its renters keep their instances
    assert api.post(f"{URL}{inst.pk}/start/").status_code == 202


def test_failed_instance_can_only_be_destroyed(api, user):
    node = make_listed_node(gpu_count=1)
    inst = book(user, node)
    svc.instance_mark_failed(instance_id=inst.pk, message="The image could not be pulled.")
    got = api.get(f"{URL}{inst.pk}/").json()
    assert got["status"] == "failed" and got["status_message"] == "The image could not be pulled."
    assert gpu_statuses(node) == ["free"]
    for verb in ("stop", "start", "restart"):
        r = api.post(f"{URL}{inst.pk}/{verb}/")
        assert r.status_code == 409 and "failed" in r.json()["detail"]
    assert api.delete(f"{URL}{inst.pk}/").status_code == 202


def test_node_cannot_be_retired_while_rented(api, client_for):
    provider = UserFactory()
    node = make_listed_node(provider, gpu_count=1)
    post(api, body(node))
    assert client_for(provider).delete(f"/api/v1/nodes/{node.pk}/").status_code == 409


def test_deleting_a_key_leaves_instances_alone(api, user):
    node = make_listed_node()
    key = add_key(user)
    inst = post(api, body(node, ssh_keys=[key.pk])).json()
    assert api.delete(f"/api/v1/ssh-keys/{key.pk}/").status_code == 204
    assert key.public_key in api.get(f"{URL}{inst['id']}/").json()["ssh_public_keys"]
    assert not SshKey.objects.filter(pk=key.pk).exists()
