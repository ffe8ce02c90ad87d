"""What the offers show of MIG slices is what a booking can take (marketplace.selectors.free_slices, the booking's
statement in instances/mig.py). Each case was found by review against PostgreSQL: a split GPU fallen off the bus
kept its free slices on the offers and bookable; a libvirt node's slices were offered and booked, and its agent
refuses MIG; the old profile's slices of a re-declared layout stayed on the offers at "$0.000000", each booking a
400."""
from decimal import Decimal

import pytest
from django.utils import timezone

from core.errors import Conflict, ValidationFailed
from marketplace.models import Gpu, GpuStatus, Instance, MigSlice, Node, SliceStatus
from marketplace.selectors import offers_search
from marketplace.services import instances as svc
from marketplace.services.instances.mig import allocate_free_slices_orm
from provisioning.services.fleet_record import nodes_record_health
from provisioning.services.nodes import HealthResult
from tests.billing.helpers import fund

from .mig_helpers import make_mig_node, prove
from .renting_helpers import book, ed25519_key, run, sent_jobs_fixture, snapshot  # noqa: F401

pytestmark = pytest.mark.django_db

OFFERS = "/api/v1/offers/"
INSTANCES = "/api/v1/instances/"


def offer(anon, node) -> dict | None:
    return next((o for o in anon.get(OFFERS).json()["results"] if o["id"] == node.pk), None)


def slices_offered(anon, node) -> dict[str, int]:
    found = offer(anon, node)
    return {s["mig_profile"]: s["num_free"] for s in found["mig_slices"]} if found else {}


def post_booking(api, node, profile: str = "3g.40gb", count: int = 1):
    return api.post(INSTANCES, {"offer": node.pk, "num_gpus": count, "mig_profile": profile,
                                "image": "pytorch-2-5", "ssh_public_key": ed25519_key()}, format="json")


# --- a split GPU fallen off the bus ---------------------------------------------------------------------------

def with_uuids(node) -> dict[int, str]:
    for gpu in node.gpus.all():
        Gpu.objects.filter(pk=gpu.pk).update(uuid=f"GPU-{node.pk}-{gpu.index}")
    return dict(node.gpus.values_list("index", "uuid"))


def health_check(node, uuids, vms=None) -> None:
    """A healthy answer of the node listing these GPU UUIDs (provisioning's recording of a health check)."""
    nodes_record_health([HealthResult(node.pk, True, vms=vms or {}, gpu_uuids=list(uuids),
                                      probed_at=timezone.now())], running_vm_ids={})


def test_a_lost_split_gpus_slices_leave_the_offers_and_booking_and_come_back_with_it(anon, api):
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, {"3g.40gb": "0.80"}, gpu_count=2)
    uuids = with_uuids(node)
    health_check(node, uuids.values())
    assert slices_offered(anon, node) == {"3g.40gb": 2}

    health_check(node, [uuids[1]])  # GPU 0, the split one, is no longer listed by nvidia-smi
    assert Gpu.objects.get(node=node, index=0).lost_at is not None
    assert slices_offered(anon, node) == {}
    assert offer(anon, node)["num_gpus_free"] == 1  # still offered: GPU 1 is whole and free
    assert anon.get(f"{OFFERS}?mig_profile=3g.40gb").json()["results"] == []
    before = snapshot(node)
    r = post_booking(api, node)
    assert r.status_code == 400 and "has 0 free MIG 3g.40gb slices" in r.json()["num_gpus"][0], r.content
    assert snapshot(node) == before and not Instance.objects.filter(node=node).exists()

    health_check(node, uuids.values())  # listed again
    assert slices_offered(anon, node) == {"3g.40gb": 2}
    assert post_booking(api, node).status_code == 201


def test_a_lost_split_gpus_slices_are_taken_by_neither_statement_of_booking(user):
    """The booking's one statement (PostgreSQL) and the ORM's (SQLite) both leave a lost GPU's slices."""
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, gpu_count=1)
    Gpu.objects.filter(node=node, index=0).update(lost_at=timezone.now())
    instance = Instance(renter=user, node=node, gpu_model_id=node.gpu_model_id, num_gpus=1, mig_profile="3g.40gb",
                        price_per_gpu_hour_micros=1, price_per_hour_micros=1, disk_gb=20)
    assert allocate_free_slices_orm(instance, node.pk, "3g.40gb", 1, timezone.now()) == 0
    with pytest.raises(ValidationFailed, match="0 free MIG 3g.40gb"):
        book(user, node, mig_profile="3g.40gb")


def test_a_slice_let_go_while_its_gpu_is_lost_is_unavailable_until_the_card_is_back(user):
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, gpu_count=1)
    uuids = with_uuids(node)
    health_check(node, uuids.values())
    fund(user, "50")
    instance = run(book(user, node, mig_profile="3g.40gb"))
    held = MigSlice.objects.get(allocations__instance=instance)
    other = MigSlice.objects.filter(node=node).exclude(pk=held.pk).get()

    vm = {f"inst-{instance.pk}": "running"}
    health_check(node, uuids.values(), vms=vm)
    health_check(node, [], vms=vm)  # the card is gone: its instance is interrupted and waits for it
    instance.refresh_from_db()
    assert instance.status == "interrupted" and instance.interruptions.get().cause == "gpu_lost"
    svc.instance_destroy(instance=Instance.objects.get(pk=instance.pk))
    svc.instance_cleanup_done(instance_id=instance.pk)
    held.refresh_from_db()
    assert held.status == SliceStatus.UNAVAILABLE  # as a lost whole GPU let go (instance_release_gpus)
    assert not offers_search().filter(pk=node.pk).exists()

    health_check(node, uuids.values())
    held.refresh_from_db()
    other.refresh_from_db()
    assert (held.status, other.status) == (SliceStatus.FREE, SliceStatus.FREE)
    assert offers_search().filter(pk=node.pk).exists()


def test_a_slice_its_check_did_not_prove_stays_unavailable_when_the_card_is_back(user):
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, gpu_count=1)
    uuids = with_uuids(node)
    prove(node, {0: ["3g.40gb"]})  # the second slice is not proven again
    unproven = MigSlice.objects.get(node=node, device=1)
    assert unproven.status == SliceStatus.UNAVAILABLE
    health_check(node, [])
    health_check(node, uuids.values())
    unproven.refresh_from_db()
    assert unproven.status == SliceStatus.UNAVAILABLE


def test_a_stopped_mig_instance_does_not_start_on_a_lost_gpus_slices(user):
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, gpu_count=1)
    fund(user, "50")
    instance = run(book(user, node, mig_profile="3g.40gb"))
    svc.instance_stop(instance=instance)
    svc.instance_mark_stopped(instance_id=instance.pk)
    Gpu.objects.filter(node=node, index=0).update(lost_at=timezone.now())
    with pytest.raises(Conflict, match="MIG slices"):
        svc.instance_start(instance=Instance.objects.get(pk=instance.pk))
    assert not MigSlice.objects.filter(node=node, status=SliceStatus.RENTED).exists()


# --- libvirt nodes rent no slices ----------------------------------------------------------------------------

def _register(**overrides) -> dict:
    from .test_api_nodes import valid_payload
    return valid_payload(**{"gpu_model": "a100-80gb-sxm", "runtime": "libvirt",
                            "mig_layout": [{"gpu": 0, "profiles": ["3g.40gb", "3g.40gb"]}],
                            "mig_prices": {"3g.40gb": "0.80"}, **overrides})


def test_a_libvirt_node_is_refused_a_mig_layout(api):
    before = Node.objects.count()
    r = api.post("/api/v1/nodes/", _register(), format="json")
    assert r.status_code == 400 and "libvirt runtime cannot rent MIG slices" in r.json()["mig_layout"][0], r.content
    assert Node.objects.count() == before
    r = api.post("/api/v1/nodes/", _register(mig_layout=[], mig_prices={}), format="json")
    assert r.status_code == 201, r.content
    node_id = r.json()["id"]
    r = api.patch(f"/api/v1/nodes/{node_id}/", {"mig_layout": [{"gpu": 0, "profiles": ["7g.80gb"]}],
                                                "mig_prices": {"7g.80gb": "1.00"}}, format="json")
    assert r.status_code == 400 and "libvirt runtime cannot rent MIG slices" in r.json()["mig_layout"][0]
    assert Node.objects.get(pk=node_id).mig_layout == []


def test_a_libvirt_nodes_slices_declared_before_are_neither_offered_nor_booked(anon, api):
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, gpu_count=1)
    Node.objects.filter(pk=node.pk).update(runtime="libvirt")  # a layout declared before the refusal
    assert offer(anon, node) is None  # nothing else to book on it: not listed
    before = snapshot(node)
    r = post_booking(api, node)
    assert r.status_code == 400 and "rents no MIG slices" in r.json()["mig_profile"][0], r.content
    assert snapshot(node) == before and not Instance.objects.filter(node=node).exists()
    # the provider may still take the layout down
    provider_api_node = Node.objects.get(pk=node.pk)
    from marketplace.services.nodes import node_update
    assert node_update(node=provider_api_node, mig_layout=[], mig_prices={}).mig_layout == []


# --- a layout declared anew: its prices take effect at once, its slices at the next check ----------------------

def test_the_old_profiles_slices_leave_the_offers_when_the_layout_is_declared_anew(anon, api, client):
    from marketplace.services.nodes import node_update
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"], 1: ["7g.80gb"]}, {"3g.40gb": "0.80", "7g.80gb": "1.60"})
    node_update(node=node, mig_layout=[{"gpu": 0, "profiles": ["1g.10gb"] * 7}, {"gpu": 1, "profiles": ["7g.80gb"]}],
                mig_prices={"1g.10gb": Decimal("0.25"), "7g.80gb": Decimal("1.60")})
    # the 3g.40gb slices are still free on the card until the next check, but no longer priced: not offered
    assert MigSlice.objects.filter(node=node, profile="3g.40gb", status=SliceStatus.FREE).count() == 2
    assert offer(anon, node)["mig_slices"] == [
        {"gpu_model": "a100-80gb-sxm", "mig_profile": "7g.80gb", "memory_gb": 80, "num_free": 1,
         "price_per_slice_hour": "1.600000"}]
    assert anon.get(f"{OFFERS}{node.pk}/").json()["mig_slices"] == offer(anon, node)["mig_slices"]
    assert anon.get(f"{OFFERS}?mig_profile=3g.40gb").json()["results"] == []
    page = client.get("/offers/").content.decode()
    assert "× 3g.40gb" not in page and "$0.00/h" not in page and "MIG: 1 × 7g.80gb $1.60/h" in page


def test_a_node_with_no_layout_left_and_every_gpu_still_split_is_not_listed(anon, client):
    from marketplace.services.nodes import node_update
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, gpu_count=1)
    assert offer(anon, node) is not None
    node_update(node=node, mig_layout=[], mig_prices={})
    assert Gpu.objects.get(node=node).status == GpuStatus.MIG  # until the next check
    assert offer(anon, node) is None
    assert f"/offers/{node.pk}/rent/" not in client.get("/offers/").content.decode()


def test_a_verification_while_a_split_card_is_lost_keeps_its_uuid_for_its_slice_renter(user):
    """A verification reading the inventory while a split card was lost let go of the card's UUID when only a slice
    of it was rented (its holders were counted by whole-card allocations only): no health check could see the card
    come back, and its renter waited for a card the platform no longer knew (found by review)."""
    from provisioning.services.nodes import node_apply_inventory

    node = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, gpu_count=2)
    uuids = with_uuids(node)
    health_check(node, uuids.values())
    fund(user, "50")
    instance = run(book(user, node, mig_profile="3g.40gb"))
    vm = {f"inst-{instance.pk}": "running"}
    health_check(node, uuids.values(), vms=vm)
    health_check(node, [uuids[1]], vms=vm)  # the split card is gone; its renter is interrupted and waits
    assert Instance.objects.get(pk=instance.pk).status == "interrupted"
    node_apply_inventory(node=node, inventory={"gpus": [{"index": 0, "uuid": uuids[1], "name": "x"}]})
    card = Gpu.objects.filter(node=node, uuid=uuids[0]).first()
    assert card is not None and card.lost_at is not None, "the lost card's row let go of its UUID"
    health_check(node, uuids.values(), vms=vm)  # back: known, no longer lost
    assert Gpu.objects.get(node=node, uuid=uuids[0]).lost_at is None
