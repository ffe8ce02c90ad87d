"""A MIG UUID answered on two cards: the inventory's check looked for a GPU index twice, never a MIG UUID, and the
check's slices are keyed by UUID, so one of two cards declared split got no slice row and stayed `free`: in MIG
mode on the server, declared split, yet counted among the node's free GPUs and bookable whole. Now the MIG check
names each card listing a repeated MIG UUID (or a MIG device number twice) and withholds its slices, and applying a
check's slices never leaves a card declared split free, whatever slices it got (found by review). The repeat is no
malformed inventory: that was a finding about no card, which cut every renter of the node
(test_mig_repeat_per_card)."""
from decimal import Decimal

from django.db import transaction

from marketplace.mig import layout_by_gpu
from marketplace.models import Gpu, GpuStatus, MigSlice, Node, SliceStatus
from provisioning.models import NodeEvent
from provisioning.services.mig import node_apply_mig_slices
from provisioning.verification.answers import benchmark_problems, inventory_problems
from provisioning.verification.mig import judge_mig
from provisioning.verification.model import DeclaredModel
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.mig_helpers import make_mig_node, slice_uuid
from tests.provisioning.test_agent_answers import honest_benchmark, honest_inventory

LAYOUT = [{"gpu": 0, "profiles": ["7g.80gb"]}, {"gpu": 1, "profiles": ["7g.80gb"]}]


def inventory(uuids=("MIG-same", "MIG-same")):
    answer = honest_inventory()
    for gpu in answer["gpus"]:
        gpu["mig_mode"] = "Enabled"
    answer["mig"] = [{"gpu": i, "device": 0, "profile": "7g.80gb", "uuid": uuid} for i, uuid in enumerate(uuids)]
    return answer


def slice_row(uuid: str, gpu: int) -> dict:
    row = {k: v for k, v in honest_benchmark([0])["gpus"][0].items() if k not in ("index", "uuid", "name")}
    return {**row, "uuid": uuid, "gpu": gpu, "device": 0, "profile": "7g.80gb", "memory_mib": 80896}


def split_node() -> Node:
    return make_listed_node(UserFactory(), gpu_model="a100-80gb-sxm", gpu_count=2, mig_layout=LAYOUT,
                            mig_prices={"7g.80gb": Decimal("1.0")})


def apply(node: Node, slices: list[dict], listable: bool = True) -> dict[int, str]:
    with transaction.atomic():
        node_apply_mig_slices(node=Node.objects.select_for_update().get(pk=node.pk), slices=slices,
                              listable=listable)
    return dict(Gpu.objects.filter(node=node).values_list("index", "status"))


# ------------------------------------------------------------------------------------ the answers' check

def test_a_mig_uuid_answered_twice_is_judged_per_card_not_a_malformed_inventory():
    assert inventory_problems(inventory()) == []
    assert inventory_problems(inventory(("MIG-a", "MIG-b"))) == []


def test_a_mig_slice_measured_twice_by_the_benchmark_is_named():
    bench = {"gpus": [], "mig_slices": [slice_row("MIG-a", 0), slice_row("MIG-a", 0)]}
    assert benchmark_problems(bench, [], ["MIG-a"]) == ["mig_slices[1].uuid repeats MIG slice MIG-a "
                                                        "(also at mig_slices[0].uuid)"]


# ------------------------------------------------------------------------------------ the MIG check

def judged(db_node: Node, uuids=("MIG-same", "MIG-same")):
    declared = DeclaredModel.from_gpu_model(db_node.gpu_model)
    bench = {"gpus": [], "mig_slices": [slice_row(uuid, n) for n, uuid in enumerate(dict.fromkeys(uuids))]}
    return judge_mig(declared, layout_by_gpu(LAYOUT), inventory(uuids), bench)


def test_a_repeated_mig_uuid_is_a_rejecting_finding_and_no_slice_is_proven(db):
    mig = judged(split_node())
    assert [(f.severity, f.code, f.gpu_index) for f in mig.findings] == [("reject", "mig_uuid_repeated", 0),
                                                                         ("reject", "mig_uuid_repeated", 1)], mig
    assert "GPU 0's MIG device UUID MIG-same is also reported by GPU 1" in mig.findings[0].message
    assert mig.slices == []  # both cards withheld: no slice of theirs listed, none proven
    honest = judged(split_node(), ("MIG-a", "MIG-b"))
    assert honest.findings == [] and [s["proven"] for s in honest.slices] == [True, True]


# ------------------------------------------------------------------------------------ applying the slices

def test_a_card_declared_split_is_not_left_rentable_whole_by_a_repeated_mig_uuid(db):
    """The slices as the check gave them before it named the repeat: both proven, one UUID."""
    node = split_node()
    slices = [{"gpu": gpu, "device": 0, "profile": "7g.80gb", "uuid": "MIG-same", "memory_mib": 80896,
               "proven": True} for gpu in (0, 1)]
    statuses = apply(node, slices)
    assert statuses == {0: GpuStatus.MIG, 1: GpuStatus.MIG}, statuses
    assert not MigSlice.objects.filter(node=node, status=SliceStatus.FREE).exists()


def test_the_check_of_a_repeated_mig_uuid_leaves_no_card_free_and_lists_no_slice(db):
    node = split_node()
    statuses = apply(node, [dict(s) for s in judged(node).slices])
    assert GpuStatus.FREE not in statuses.values(), statuses
    assert not MigSlice.objects.filter(node=node, status=SliceStatus.FREE).exists()


def test_a_card_declared_split_whose_slices_another_node_holds_is_not_left_free(db):
    """The other way a card got no slice row: its MIG UUID is another node's slice (mig_slices_duplicate)."""
    other = make_mig_node({0: ["7g.80gb"]}, gpu_count=1)
    node = split_node()
    taken = slice_uuid(other.pk, 0, 0)
    slices = [{"gpu": 0, "device": 0, "profile": "7g.80gb", "uuid": taken, "memory_mib": 80896, "proven": True},
              {"gpu": 1, "device": 0, "profile": "7g.80gb", "uuid": "MIG-own", "memory_mib": 80896, "proven": True}]
    statuses = apply(node, slices)
    assert NodeEvent.objects.filter(node=node, kind="mig_slices_duplicate").exists()
    assert statuses == {0: GpuStatus.MIG, 1: GpuStatus.MIG}, statuses


def test_a_card_no_longer_declared_split_still_goes_back_to_whole_renting(db):
    node = make_mig_node({0: ["7g.80gb"]}, gpu_count=2)
    assert apply(node, []) == {0: GpuStatus.MIG, 1: GpuStatus.FREE}
    Node.objects.filter(pk=node.pk).update(mig_layout=[])
    assert apply(Node.objects.get(pk=node.pk), []) == {0: GpuStatus.FREE, 1: GpuStatus.FREE}
