"""MIG slices end to end: a provider declares a layout, a real worker verifies it over SSH on a simulated server,
the slices are offered, a renter rents one and, logged in to the VM, sees only that slice in `nvidia-smi -L`."""
import json

import pytest

from marketplace.models import Gpu, Instance, MigSlice, Node
from provisioning.models import VerificationRun
from tests.e2e.conftest import wait_until
from tests.e2e.test_instances import _renter_key, _ssh, _status

pytestmark = pytest.mark.slow

PROFILE = "a100-80gb-sxm-x2-mig"
LAYOUT = [{"gpu": 0, "profiles": ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]}]
PRICES = {"3g.40gb": "0.700000", "2g.20gb": "0.450000", "1g.10gb": "0.250000"}


def _profile_slices(name):
    from provisioning.verification.profiles import PROFILES_DIR
    return json.loads((PROFILES_DIR / f"{name}.json").read_text())["mig"]["0"]


def _verify(api, node):
    assert api.post(f"/api/v1/nodes/{node.pk}/verify/").status_code == 202
    wait_until(lambda: Node.objects.get(pk=node.pk).state in ("active", "rejected"), 90,
               what="the node's check to end")
    return Node.objects.get(pk=node.pk)


def test_declare_verify_offer_rent_and_see_only_the_slice(worker, sim_node_factory, api, other_api, tmp_path):
    node, _ = sim_node_factory(api, profile=PROFILE, gpu_model="a100-80gb-sxm", gpu_count=2, mig_layout=LAYOUT,
                               mig_prices=PRICES)
    node = _verify(api, node)
    assert (node.state, node.verdict) == ("active", "verified"), (node.last_error, worker.tail())

    # The check proved each slice; GPU 0 is split (never rented whole), GPU 1 stays whole.
    run = VerificationRun.objects.filter(node=node).latest("created_at")
    proven = {s["uuid"]: s for s in run.figures["mig_slices"]}
    configured = _profile_slices(PROFILE)
    assert set(proven) == {s["uuid"] for s in configured} and all(s["proven"] for s in proven.values())
    slices = {s.uuid: s for s in MigSlice.objects.filter(node=node)}
    assert {u: (s.profile, s.status) for u, s in slices.items()} == {
        s["uuid"]: (s["profile"], "free") for s in configured}
    assert list(Gpu.objects.filter(node=node).order_by("index").values_list("status", flat=True)) == ["mig", "free"]
    mine = api.get(f"/api/v1/nodes/{node.pk}/").json()
    assert mine["mig_layout"] == LAYOUT and mine["mig_prices"] == PRICES and len(mine["mig_slices"]) == 4

    # Offers show the free slices per profile, with the slice price; the filter finds the node by profile.
    offer = other_api.get("/api/v1/offers/?mig_profile=3g.40gb").json()["results"]
    assert [o["id"] for o in offer] == [node.pk]
    assert offer[0]["num_gpus_free"] == 1
    assert offer[0]["mig_slices"] == [
        {"gpu_model": "a100-80gb-sxm", "mig_profile": "1g.10gb", "memory_gb": 10, "num_free": 2,
         "price_per_slice_hour": "0.250000"},
        {"gpu_model": "a100-80gb-sxm", "mig_profile": "2g.20gb", "memory_gb": 20, "num_free": 1,
         "price_per_slice_hour": "0.450000"},
        {"gpu_model": "a100-80gb-sxm", "mig_profile": "3g.40gb", "memory_gb": 40, "num_free": 1,
         "price_per_slice_hour": "0.700000"}]
    assert other_api.get(f"/api/v1/offers/{node.pk}/").json()["mig_slices"] == offer[0]["mig_slices"]

    # Rent one 3g.40gb slice; the VM sees that slice and nothing else of the card.
    key_path, public = _renter_key(tmp_path)
    r = other_api.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "mig_profile": "3g.40gb",
                                              "image": "pytorch-2-5", "ssh_public_key": public}, format="json")
    assert r.status_code == 201, r.content
    instance = _status(r.json()["id"], "running", "failed", timeout=90)
    assert instance.status == "running", (instance.status_message, worker.tail())
    assert instance.price_per_hour_micros == 700_000 and instance.mig_profile == "3g.40gb"
    body = other_api.get(f"/api/v1/instances/{instance.pk}/").json()
    wanted = next(s for s in configured if s["profile"] == "3g.40gb")
    assert body["mig_slices"] == [wanted["uuid"]] and body["gpus"] == [0] and body["price_per_hour"] == "0.700000"
    out = _ssh(body["ssh_command"], key_path, "nvidia-smi -L; echo CVD=$CUDA_VISIBLE_DEVICES")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-")
    assert [ln.split()[:2] for ln in lines[1:-1]] == [["MIG", "3g.40gb"]]
    assert wanted["uuid"] in lines[1] and lines[-1] == f"CVD={wanted['uuid']}"
    assert all(s["uuid"] not in out.stdout for s in configured if s["uuid"] != wanted["uuid"])

    # The slice is taken: the offer says so, and a second 3g.40gb is refused naming the field.
    left = other_api.get(f"/api/v1/offers/{node.pk}/").json()["mig_slices"]
    assert [s["mig_profile"] for s in left] == ["1g.10gb", "2g.20gb"]
    again = other_api.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "mig_profile": "3g.40gb",
                                                  "image": "pytorch-2-5", "ssh_public_key": public}, format="json")
    assert again.status_code == 400 and "0 free MIG 3g.40gb" in again.json()["num_gpus"][0], again.content

    # Destroyed, it frees the slice again.
    assert other_api.delete(f"/api/v1/instances/{instance.pk}/").status_code == 202
    _status(instance.pk, "destroyed", timeout=60)
    assert MigSlice.objects.get(uuid=wanted["uuid"]).status == "free"
    assert Instance.objects.get(pk=instance.pk).slice_allocations.filter(released_at__isnull=True).count() == 0


@pytest.mark.parametrize(("profile", "codes"), [
    ("a100-80gb-sxm-x2-mig-not-configured", {"mig_not_configured"}),
    ("a100-80gb-sxm-x2-mig-slices-smaller", {"mig_slice_memory", "mig_slice_slow", "mig_slice_challenge_too_slow",
                                             "mig_slice_memory_proof_late"}),
    # honest figures from the node; only the platform's own challenge of the slice sees it is slower
    ("a100-80gb-sxm-x2-mig-slice-slow", {"mig_slice_challenge_too_slow"}),
])
def test_dishonest_layouts_are_rejected_over_ssh(worker, sim_node_factory, api, profile, codes):
    node, _ = sim_node_factory(api, profile=profile, gpu_model="a100-80gb-sxm", gpu_count=2, mig_layout=LAYOUT,
                               mig_prices=PRICES)
    node = _verify(api, node)
    run = VerificationRun.objects.filter(node=node).latest("created_at")
    assert node.verdict == "rejected" and codes <= {f["code"] for f in run.findings}, (run.findings, worker.tail())
    assert not MigSlice.objects.filter(node=node, status="free").exists()


def test_an_undeclared_mig_layout_is_still_rejected(worker, sim_node_factory, api):
    node, _ = sim_node_factory(api, profile=PROFILE, gpu_model="a100-80gb-sxm", gpu_count=2)
    node = _verify(api, node)
    run = VerificationRun.objects.filter(node=node).latest("created_at")
    assert node.verdict == "rejected" and "mig_enabled" in {f["code"] for f in run.findings}
    assert not MigSlice.objects.filter(node=node).exists()
