"""MIG slices in the marketplace: the catalogue's profiles, declaring a layout (and every bad one), slices in
offers (both paths write the same fields), booking slices, and billing at the slice price."""
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import transaction
from django.utils import timezone

from billing.services.metering import usage_close
from marketplace.mig import layout_problems, profiles_for
from marketplace.models import Gpu, GpuModel, GpuStatus, Instance, MigSlice, Node
from marketplace.services import instances as svc
from provisioning.services.mig import node_apply_mig_slices
from tests.factories import UserFactory, make_listed_node

from .mig_helpers import SEVEN, make_mig_node, prove
from .renting_helpers import book, ed25519_key, run, sent_jobs_fixture, snapshot  # noqa: F401
from .test_api_nodes import valid_payload

pytestmark = pytest.mark.django_db

NODES = "/api/v1/nodes/"
LAYOUT = [{"gpu": 0, "profiles": ["3g.40gb", "3g.40gb"]}]


# --- the catalogue ------------------------------------------------------------------------------------------

def test_gpu_models_list_their_mig_profiles(anon):
    models = {m["slug"]: m for m in anon.get("/api/v1/gpu-models/").json()}
    for slug, model in models.items():
        assert model["mig_supported"] == bool(model["mig_profiles"]), slug
    a100 = {p["name"]: p for p in models["a100-80gb-sxm"]["mig_profiles"]}
    assert set(a100) == {"1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"}
    assert a100["3g.40gb"] == {"name": "3g.40gb", "compute_slices": 3, "memory_slices": 4, "memory_gb": 40,
                               "compute_fraction": 0.4286, "memory_fraction": 0.5}
    assert {p["name"] for p in models["a100-40gb-pcie"]["mig_profiles"]} >= {"1g.5gb", "7g.40gb"}
    assert {p["name"] for p in models["h200-sxm"]["mig_profiles"]} >= {"1g.18gb", "7g.141gb"}
    assert models["rtx-a4000"]["mig_profiles"] == []


def test_every_mig_capable_catalogue_model_has_profiles_and_only_those():
    for model in GpuModel.objects.all():
        profiles = profiles_for(model.slug)
        assert bool(profiles) == model.mig_supported, model.slug
        # the largest profile fills the card: 7 compute slices and 8 memory slices, no more
        if profiles:
            largest = max(profiles.values(), key=lambda p: p.compute_slices)
            assert (largest.compute_slices, largest.memory_slices) == (7, 8)
            assert largest.memory_gb == model.memory_gb or model.slug == "h200-sxm"


@pytest.mark.parametrize(("layout", "words"), [
    ([{"gpu": 0, "profiles": ["7g.80gb", "1g.10gb"]}], "overfills GPU 0: its profiles take 8 compute"),
    ([{"gpu": 0, "profiles": ["4g.40gb", "4g.40gb"]}], "overfills"),  # 8 compute slices of 7
    ([{"gpu": 0, "profiles": ["3g.40gb", "3g.40gb", "1g.10gb"]}], "9 memory slices of 8"),
    ([{"gpu": 0, "profiles": ["5g.50gb"]}], "'5g.50gb' is not a MIG profile of the a100-80gb-sxm"),
    ([{"gpu": 0, "profiles": ["1g.5gb"]}], "not a MIG profile"),  # an A100 40GB profile
    ([{"gpu": 2, "profiles": ["1g.10gb"]}], "gpu must be a GPU index of this node, 0 to 1"),
    ([{"gpu": 0, "profiles": ["1g.10gb"]}, {"gpu": 0, "profiles": ["1g.10gb"]}], "GPU 0 is given twice"),
    ([{"gpu": 0, "profiles": []}], "non-empty list"),
    ([{"gpu": 0}], "must be"),
    ({"gpu": 0}, "must be a list"),
])
def test_bad_layouts_are_named(layout, words):
    assert words in layout_problems("a100-80gb-sxm", 2, layout)


def test_good_layouts_pass():
    assert layout_problems("a100-80gb-sxm", 2, [{"gpu": 1, "profiles": SEVEN}]) is None
    assert layout_problems("a100-80gb-sxm", 1, [{"gpu": 0, "profiles": ["3g.40gb", "2g.20gb", "1g.10gb",
                                                                          "1g.10gb"]}]) is None
    assert layout_problems("rtx-a4000", 2, []) is None


# --- declaring ----------------------------------------------------------------------------------------------

def _mig_payload(**overrides):
    return valid_payload(**{"gpu_model": "a100-80gb-sxm", "runtime": "sim", "mig_layout": LAYOUT,
                            "mig_prices": {"3g.40gb": "0.80"}, **overrides})


def test_a_provider_declares_a_layout_and_its_prices(api):
    r = api.post(NODES, _mig_payload(), format="json")
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["mig_layout"] == LAYOUT and body["mig_prices"] == {"3g.40gb": "0.800000"}
    assert body["mig_slices"] == []  # none until a check proves them
    node = Node.objects.get(pk=body["id"])
    assert node.mig_prices_micros == {"3g.40gb": 800_000}
    r = api.patch(f"{NODES}{node.pk}/", {"mig_prices": {"3g.40gb": "0.95"}}, format="json")
    assert r.status_code == 200 and r.json()["mig_prices"] == {"3g.40gb": "0.950000"}
    r = api.patch(f"{NODES}{node.pk}/", {"mig_layout": [{"gpu": 1, "profiles": ["7g.80gb"]}]}, format="json")
    assert r.status_code == 400 and "7g.80gb" in r.json()["mig_prices"][0]  # a new profile needs its price


@pytest.mark.parametrize(("overrides", "field", "words"), [
    ({"gpu_model": "rtx-a6000"}, "mig_layout", "has no MIG"),
    ({"mig_layout": [{"gpu": 0, "profiles": ["9g.90gb"]}]}, "mig_layout", "not a MIG profile"),
    ({"mig_layout": [{"gpu": 0, "profiles": ["7g.80gb", "1g.10gb"]}]}, "mig_layout", "overfills"),
    ({"mig_prices": {}}, "mig_prices", "Give a price per slice-hour for 3g.40gb"),
    ({"mig_prices": {"3g.40gb": "0.8", "1g.10gb": "0.2"}}, "mig_prices", "does not use"),
    ({"mig_prices": {"3g.40gb": "-1"}}, "mig_prices", ""),
    ({"mig_layout": "3g.40gb"}, "mig_layout", "must be a list"),
])
def test_bad_declarations_are_400_naming_the_field_and_write_nothing(api, overrides, field, words):
    before = Node.objects.count(), Gpu.objects.count()
    r = api.post(NODES, _mig_payload(**overrides), format="json")
    assert r.status_code == 400, r.content
    assert field in r.json() and words in str(r.json()[field]), r.json()
    assert (Node.objects.count(), Gpu.objects.count()) == before


# --- offers ---------------------------------------------------------------------------------------------------

def test_offers_show_free_slices_and_filter_by_profile(anon):
    split = make_mig_node({0: ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"], 1: SEVEN},
                          {"3g.40gb": "0.7", "2g.20gb": "0.45", "1g.10gb": "0.25"})
    whole = make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=2)
    rows = {o["id"]: o for o in anon.get("/api/v1/offers/").json()["results"]}
    assert rows[whole.pk]["mig_slices"] == []
    # every GPU of `split` is split: it is offered for its slices alone
    assert rows[split.pk]["num_gpus_free"] == 0
    assert rows[split.pk]["mig_slices"] == [
        {"gpu_model": "a100-80gb-sxm", "mig_profile": "1g.10gb", "memory_gb": 10, "num_free": 9,
         "price_per_slice_hour": "0.250000"},
        {"gpu_model": "a100-80gb-sxm", "mig_profile": "2g.20gb", "memory_gb": 20, "num_free": 1,
         "price_per_slice_hour": "0.450000"},
        {"gpu_model": "a100-80gb-sxm", "mig_profile": "3g.40gb", "memory_gb": 40, "num_free": 1,
         "price_per_slice_hour": "0.700000"}]
    # the single-offer read (the serializer) writes what the list's fast path writes
    assert anon.get(f"/api/v1/offers/{split.pk}/").json() == rows[split.pk]
    found = anon.get("/api/v1/offers/?mig_profile=2g.20gb").json()["results"]
    assert [o["id"] for o in found] == [split.pk]
    assert anon.get("/api/v1/offers/?mig_profile=7g.80gb").json()["results"] == []
    bad = anon.get("/api/v1/offers/?mig_profile=9g.90gb")
    assert bad.status_code == 400 and "mig_profile" in bad.json()


def test_slices_of_a_node_the_check_did_not_list_are_not_offered(anon):
    node = make_mig_node({0: ["7g.80gb"]}, gpu_count=1)
    prove(node, {0: ["7g.80gb"]}, listable=False)
    assert set(MigSlice.objects.filter(node=node).values_list("status", flat=True)) == {"unavailable"}
    assert node.pk not in [o["id"] for o in anon.get("/api/v1/offers/").json()["results"]]


# --- booking --------------------------------------------------------------------------------------------------

def test_booking_slices_takes_them_at_the_slice_price(user):
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, {"3g.40gb": "0.9"})
    instance = book(user, node, num_gpus=2, mig_profile="3g.40gb")
    assert (instance.mig_profile, instance.num_gpus) == ("3g.40gb", 2)
    assert (instance.price_per_gpu_hour_micros, instance.price_per_hour_micros) == (900_000, 1_800_000)
    assert sorted(svc.instance_slice_uuids(instance=instance)) == sorted(
        MigSlice.objects.filter(node=node).values_list("uuid", flat=True))
    assert svc.instance_gpu_indices(instance=instance) == [0]
    assert set(MigSlice.objects.filter(node=node).values_list("status", flat=True)) == {"rented"}
    # the parent GPU stays split: whole-GPU booking takes only GPU 1
    assert Gpu.objects.get(node=node, index=0).status == GpuStatus.MIG
    whole = book(UserFactory(), node, num_gpus=1)
    assert svc.instance_gpu_indices(instance=whole) == [1]
    with pytest.raises(Exception, match="No GPU is free"):
        book(UserFactory(), node, num_gpus=1)


@pytest.mark.parametrize(("profile", "count", "field", "words"), [
    ("1g.10gb", 1, "mig_profile", "rents no MIG 1g.10gb slices (its MIG profiles: 3g.40gb)"),
    ("3g.40gb", 3, "num_gpus", "has 2 free MIG 3g.40gb slices; ask for 1 to 2"),
])
def test_bad_slice_bookings_are_400_naming_the_field_and_write_nothing(api, profile, count, field, words):
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, gpu_count=1)
    before = snapshot(node)
    r = api.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": count, "mig_profile": profile,
                                        "image": "pytorch-2-5", "ssh_public_key": ed25519_key()}, format="json")
    assert r.status_code == 400 and words in r.json()[field][0], r.content
    assert snapshot(node) == before and not Instance.objects.filter(node=node).exists()


def test_releasing_a_slice_instance_frees_its_slices_and_a_restart_takes_them_back(user):
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, gpu_count=1)
    instance = run(book(user, node, num_gpus=1, mig_profile="3g.40gb"))
    held = svc.instance_slice_uuids(instance=instance)
    svc.instance_stop(instance=instance)
    svc.instance_mark_stopped(instance_id=instance.pk)
    assert MigSlice.objects.get(uuid=held[0]).status == "free"
    started = svc.instance_start(instance=Instance.objects.get(pk=instance.pk))
    assert started.status == "starting" and svc.instance_slice_uuids(instance=started) == held


def test_billing_meters_a_slice_instance_at_its_slice_price(user, settings):
    settings.BILLING_REQUIRE_FUNDS = False
    node = make_mig_node({0: ["1g.10gb"] * 7}, {"1g.10gb": "0.36"}, gpu_count=1)
    instance = run(book(user, node, num_gpus=2, mig_profile="1g.10gb"))
    started = instance.started_at
    usage_close(instance=Instance.objects.get(pk=instance.pk), until=started + timedelta(seconds=3600))
    billed = Instance.objects.get(pk=instance.pk)
    assert billed.billed_seconds == 3600 and billed.cost_micros == 720_000  # 2 slices x $0.36 for one hour
    assert started <= timezone.now()


def test_the_offers_page_shows_slices_and_filters_by_profile_as_the_api(client):
    split = make_mig_node({0: ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]}, {"3g.40gb": "0.7", "2g.20gb": "0.45",
                                                                           "1g.10gb": "0.25"}, gpu_count=1)
    make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=2)
    page = client.get("/offers/?mig_profile=3g.40gb").content.decode()
    # one row, its Rent link opening the form with the filtered profile chosen
    assert f'href="/offers/{split.pk}/rent/?mig_profile=3g.40gb"' in page and page.count('/rent/?') == 1
    assert "MIG: 2 × 1g.10gb $0.25/h · 1 × 2g.20gb $0.45/h · 1 × 3g.40gb $0.70/h" in page
    assert client.get("/offers/?mig_profile=9g.90gb").status_code == 400


def test_a_node_with_a_rented_slice_cannot_be_retired(api, user):
    node = make_mig_node({0: ["7g.80gb"]}, gpu_count=1, provider=user)
    renter = UserFactory()
    book(renter, node, num_gpus=1, mig_profile="7g.80gb")
    r = api.delete(f"{NODES}{node.pk}/")
    assert r.status_code == 409 and "renters' instances are live on it (1 requested)" in r.json()["detail"]


def test_an_operator_cannot_move_a_split_gpu_out_of_mig_in_the_admin(admin_client):
    from django.urls import reverse
    node = make_mig_node({0: ["7g.80gb"]}, gpu_count=2)
    split, whole = node.gpus.order_by("index")
    page = admin_client.get(reverse("admin:marketplace_gpu_change", args=[split.pk]))
    assert page.status_code == 200 and 'name="status"' not in page.content.decode()
    page = admin_client.get(reverse("admin:marketplace_gpu_change", args=[whole.pk]))
    assert page.status_code == 200 and 'name="status"' in page.content.decode()


def test_a_retired_mig_server_lets_go_of_its_slices_and_registered_again_they_are_listed(api, user):
    """Its GPUs let go of their UUIDs on retire; its slices kept theirs, so the same server registered again had
    none listed (each an IntegrityError on mig_slice_unique_uuid, said as 'the same card listed twice')."""
    from marketplace.models import SliceStatus
    from provisioning.models import NodeEvent

    first = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, gpu_count=1, provider=user)
    uuids = sorted(first.mig_slices.values_list("uuid", flat=True))
    assert api.delete(f"{NODES}{first.pk}/").status_code == 204
    assert set(first.mig_slices.values_list("uuid", "status")) == {("", SliceStatus.UNAVAILABLE)}
    again = make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=1, provider=user,
                             mig_layout=[{"gpu": 0, "profiles": ["3g.40gb", "3g.40gb"]}],
                             mig_prices={"3g.40gb": Decimal("0.70")})
    slices = [{"gpu": 0, "device": n, "profile": "3g.40gb", "uuid": uuid, "memory_mib": 40192, "proven": True}
              for n, uuid in enumerate(uuids)]
    with transaction.atomic():
        node_apply_mig_slices(node=Node.objects.select_for_update().get(pk=again.pk), slices=slices, listable=True)
    assert sorted(MigSlice.objects.filter(node=again, status=SliceStatus.FREE).values_list("uuid", flat=True)) == uuids
    assert not NodeEvent.objects.filter(node=again, kind="mig_slices_duplicate").exists()
