"""One GPU UUID reported by two cards of a node. The policy rejects it (`gpu_uuid_repeated`: one finding per card
sharing the UUID, each message naming them all), and the inventory claims none of the node's UUIDs
(nodes._apply_inventory: which card the UUID is cannot be told, and one row only may hold it). Before, the
rejection's renters (verification.renters_concerned) were found from the first index alone (the only one its
finding named then), through the UUID as held before: a UUID two cards report named one holder, often the wrong
one (the renter of the card now reporting another's UUID went unconcerned, its price never cut). Now every card
sharing the UUID is concerned: the holders of that UUID and those of the rows at every index reporting it. And a
lost card a renter holds, which such an inventory does not list, keeps its UUID (it let go of it before, and was
never matched back)."""

import pytest
from django.utils import timezone

from marketplace.models import Gpu, GpuAllocation
from provisioning.services.nodes import node_apply_inventory
from provisioning.services.verification import gpu_holders_by_uuid, renters_concerned
from provisioning.verification.identity import check_identity
from provisioning.verification.model import DeclaredModel, load_catalogue
from tests.billing.helpers import fund, node, running
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db
NAME = "NVIDIA A100-SXM4-80GB"


def _renter():
    user = UserFactory()
    fund(user, "50")
    return user


def _inventory(*uuids: str) -> dict:
    return {"gpus": [{"index": i, "uuid": u, "name": NAME, "memory_total_mib": 81920} for i, u in enumerate(uuids)]}


@pytest.fixture
def two_renters():
    """A 2-GPU node whose cards hold GPU-0 and GPU-1, each rented by its own renter: (host, {uuid: instance id})."""
    host = node("1.000000", gpu_count=2)
    for gpu in Gpu.objects.filter(node=host):
        Gpu.objects.filter(pk=gpu.pk).update(uuid=f"GPU-{gpu.index}")
    first, second = running(_renter(), host), running(_renter(), host)
    held = dict(
        GpuAllocation.objects.filter(instance_id__in=[first.pk, second.pk], released_at__isnull=True).values_list(
            "gpu__uuid", "instance_id"
        )
    )
    assert sorted(held) == ["GPU-0", "GPU-1"]
    return host, held


@pytest.mark.parametrize("repeated", ["GPU-0", "GPU-1"])
def test_every_card_sharing_a_repeated_uuid_is_concerned_by_the_rejection(two_renters, repeated):
    host, held = two_renters
    holders = gpu_holders_by_uuid(host)
    inventory = _inventory(repeated, repeated)
    declared = DeclaredModel.from_catalogue(load_catalogue()["a100-80gb-sxm"])
    findings = [f.as_dict() for f in check_identity(declared, 2, inventory["gpus"]) if f.code == "gpu_uuid_repeated"]
    assert [(f["gpu_index"], f["message"].split(" report")[0]) for f in findings] == [(0, "GPUs 0, 1"),
                                                                                        (1, "GPUs 0, 1")]
    assert renters_concerned(host, findings, inventory, holders) == set(held.values())


def test_a_repeated_uuid_is_claimed_by_no_card_and_a_unique_one_still_names_only_its_holder(two_renters):
    host, held = two_renters
    holders = gpu_holders_by_uuid(host)
    node_apply_inventory(node=host, inventory=_inventory("GPU-1", "GPU-1"))
    # The repeated UUID is claimed by no card; GPU-0, listed by none, is lost (its renter waits), keeping its UUID.
    assert not Gpu.objects.filter(node=host, uuid="GPU-1").exists()
    assert Gpu.objects.get(node=host, uuid="GPU-0").lost_at is not None
    # A finding about one card whose UUID is its own alone names that card's renter only, as before.
    finding = {"severity": "reject", "code": "gpu_name", "message": "x", "gpu_index": 1}
    assert renters_concerned(host, [finding], _inventory("GPU-0", "GPU-1"), holders) == {held["GPU-1"]}


def test_a_lost_card_a_renter_holds_keeps_its_uuid_through_an_inventory_that_repeats_another():
    """The inventory that repeats a UUID claims none of the cards it lists; a lost card a renter holds, which it does
    not list, kept no UUID either: no health check judged it again, and when the cards answered each with its own
    UUID it was never matched back (a lost card a renter holds takes no unknown card), so it stayed lost and its
    renter interrupted for good. Now it keeps its UUID, as an inventory without a repeat leaves it, and is back when
    listed again."""
    host = node("1.000000", gpu_count=3)
    for gpu in Gpu.objects.filter(node=host):
        Gpu.objects.filter(pk=gpu.pk).update(uuid=f"GPU-{gpu.index}")
    instance = running(_renter(), host)
    card = GpuAllocation.objects.get(instance=instance, released_at__isnull=True).gpu
    Gpu.objects.filter(pk=card.pk).update(lost_at=timezone.now())  # fallen off the bus (gpu_presence)
    others = [f"GPU-{i}" for i in range(3) if i != card.index]
    node_apply_inventory(node=host, inventory=_inventory(others[0], others[0]))
    assert Gpu.objects.get(pk=card.pk).uuid == card.uuid
    assert sorted(Gpu.objects.filter(node=host).exclude(pk=card.pk).values_list("uuid", flat=True)) == ["", ""]
    node_apply_inventory(node=host, inventory=_inventory("GPU-0", "GPU-1", "GPU-2"))  # every card answers again
    back = Gpu.objects.get(pk=card.pk)
    assert (back.uuid, back.lost_at) == (card.uuid, None)
