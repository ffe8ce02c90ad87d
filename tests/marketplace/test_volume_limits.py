"""What a renter may create as volumes (found by review: one cent of balance created twenty 64 TiB volumes, ~$180/h
billed to a one-cent wallet while the provider was credited earnings the renter never paid):

- the funds check of renting: the balance holds one hour (BILLING_FUNDS_REQUIRED_S) of the renter's whole burn rate
  with the new volume: instances, volumes (those being created too) and stopped instances' disks; else 402 naming
  the amount;
- a cap per renter on how many volumes and how many GB in all (VOLUMES_PER_USER_MAX, VOLUMES_TOTAL_GB_PER_USER_MAX):
  409 naming it;
- no volume larger than the node's reported free disk, less the volumes made there since it reported: 409 naming it.
Each refusal leaves nothing behind (no volume, no job). Booking an instance counts the renter's storage the same way.
"""
import pytest
from django.test import override_settings

from billing.selectors import storage_burn_per_hour
from billing.services.storage import storage_rate_per_hour_micros
from marketplace.models import Volume
from marketplace.services import instances as instance_svc
from marketplace.services import volumes as volume_svc
from provisioning.models import Job
from tests.billing.helpers import fund
from tests.factories import make_listed_node

from .renting_helpers import ed25519_key, sent_jobs_fixture  # noqa: F401 (the sent_jobs fixture)

pytestmark = pytest.mark.django_db
URL = "/api/v1/volumes/"
TIB64 = 65536  # GB: the largest volume
PRICE = 100_000  # USD 0.10 per GB-month: 64 TiB is USD 9.102222 per hour


def _node(**kwargs):
    node = make_listed_node(**kwargs)
    node.disk_price_per_gb_month_micros = PRICE
    node.save()
    return node


def create(client, node, size_gb):
    return client.post(URL, {"offer": node.pk, "size_gb": size_gb}, format="json")


@override_settings(BILLING_REQUIRE_FUNDS=True)
def test_a_cent_of_balance_does_not_buy_unbounded_storage(api, user):
    """The review's reproduction: twenty creates of 64 TiB with USD 0.01. Each needs an hour of its own price."""
    node = _node()
    fund(user, "0.01")
    answers = [create(api, node, TIB64) for _ in range(20)]
    assert {r.status_code for r in answers} == {402}, [r.status_code for r in answers]
    detail = answers[0].json()["detail"]
    assert "Creating this volume needs one hour" in detail and "This volume costs $9.102222/h" in detail, detail
    assert "top up at least $9.10" in detail, detail
    assert not Volume.objects.exists() and not Job.objects.exists()


@override_settings(BILLING_REQUIRE_FUNDS=True)
def test_volumes_being_created_count_towards_the_next_ones_hour(api, user):
    """Funds for one 64 TiB volume buy one: the second counts the first, still being created (billed once it is
    made, with no other check), as a second booking counts the first instance."""
    node = _node()
    fund(user, "10")
    assert create(api, node, TIB64).status_code == 201
    second = create(api, node, TIB64)
    assert second.status_code == 402, second.content
    assert "your storage cost $9.102222/h; with this one $18.204444/h" in second.json()["detail"]
    assert Volume.objects.count() == 1


@override_settings(BILLING_REQUIRE_FUNDS=True)
def test_a_renters_storage_counts_when_they_book_an_instance(api, user):
    """A renter carrying volumes (and a stopped disk) books on an hour of everything, not of GPU time alone."""
    node = _node(gpu_count=2)
    fund(user, "12")
    volume = volume_svc.volume_create(owner=user, node_id=node.pk, size_gb=TIB64)
    volume_svc.volume_mark_available(volume_id=volume.pk)
    storage = storage_burn_per_hour(renter_id=user.pk)[user.pk]
    assert storage == storage_rate_per_hour_micros(size_gb=TIB64, price_per_gb_month_micros=PRICE) == 9_102_222
    # One rule: the funds check's committed rate is the selector's storage rate (no instance yet).
    assert instance_svc.committed_rate_micros(renter_id=user.pk) == storage
    r = api.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "image": "pytorch-2-5",
                                        "ssh_public_key": ed25519_key()}, format="json")
    # USD 1.50 for the GPU hour and USD 9.10 for the volume's fit in 12; a second GPU (3.00 more) does not.
    assert r.status_code == 201, r.content
    again = api.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "image": "pytorch-2-5",
                                            "ssh_public_key": ed25519_key()}, format="json")
    assert again.status_code == 402, again.content
    assert "your storage cost $10.602222/h; with this one $12.102222/h" in again.json()["detail"]


def test_the_committed_rate_counts_volumes_being_created_and_stopped_disks_as_the_selector_does(user):
    node = _node()
    creating = volume_svc.volume_create(owner=user, node_id=node.pk, size_gb=1000)
    made = volume_svc.volume_mark_available(
        volume_id=volume_svc.volume_create(owner=user, node_id=node.pk, size_gb=3000).pk)
    gone = volume_svc.volume_create(owner=user, node_id=node.pk, size_gb=5000)
    volume_svc.volume_mark_failed(volume_id=gone.pk, message="no")
    # The selector (what is billed now) has the available one; the funds check adds the one being created.
    assert storage_burn_per_hour(renter_id=user.pk)[user.pk] == 3000 * PRICE * 3600 // (30 * 86400)
    assert instance_svc.committed_rate_micros(renter_id=user.pk) == 4000 * PRICE * 3600 // (30 * 86400)
    assert creating.pk and made.pk


@override_settings(VOLUMES_PER_USER_MAX=2, VOLUMES_TOTAL_GB_PER_USER_MAX=100)
def test_a_renters_volumes_are_capped_in_number_and_size(api, other_api, user):
    node = _node()
    assert create(api, node, 60).status_code == 201
    too_big = create(api, node, 50)
    assert too_big.status_code == 409, too_big.content
    assert "100 GB" in too_big.json()["detail"] and "60 GB" in too_big.json()["detail"]
    assert create(api, node, 40).status_code == 201
    third = create(api, node, 1)
    assert third.status_code == 409 and "2 volumes" in third.json()["detail"], third.content
    assert create(other_api, node, 60).status_code == 201  # another renter's cap is their own
    # A deleted (or failed) volume no longer counts.
    first = Volume.objects.filter(owner=user).order_by("pk").first()
    volume_svc.volume_mark_available(volume_id=first.pk)
    volume_svc.volume_delete(volume=first, confirm=first.name)
    assert create(api, node, 60).status_code == 201
    assert Volume.objects.filter(owner=user).count() == 3


def test_a_volume_larger_than_the_nodes_free_disk_is_refused_naming_it(api):
    node = _node()
    node.disk_free_gb = 100
    node.save()
    r = create(api, node, 150)
    assert r.status_code == 409, r.content
    assert "100 GB" in r.json()["detail"] and "free" in r.json()["detail"]
    assert create(api, node, 60).status_code == 201
    # The 60 GB made there since the node reported count: 40 GB are left.
    left = create(api, node, 50)
    assert left.status_code == 409 and "40 GB" in left.json()["detail"], left.content
    assert create(api, node, 40).status_code == 201
    assert Volume.objects.count() == 2


def test_starting_a_stopped_instance_does_not_count_its_own_disk(user):
    """Its disk is billed as storage while it is stopped and no longer once it runs: the start's check counts the
    GPU time, the other storage, not that disk twice (the booked disk would otherwise be an hour's surplus)."""
    from tests.billing.helpers import book, run, stop

    node = _node()
    fund(user, "50")
    stopped = stop(run(book(user, node)))
    other = stop(run(book(user, node)))
    both = storage_burn_per_hour(renter_id=user.pk)[user.pk]
    assert instance_svc.committed_rate_micros(renter_id=user.pk) == both > 0
    funds = instance_svc.funds_for(renter_id=user.pk, price_per_hour_micros=1_500_000, starting=stopped.pk)
    assert funds.committed_rate_micros == storage_rate_per_hour_micros(
        size_gb=other.disk_gb, price_per_gb_month_micros=PRICE) < both
