"""Review r52, finding 1, as the reviewer probed it (no SSH): a renter leaving a card its provider declared anew
queues no check, tells the provider the card is free to re-split, withholds the card, and the check's judgement of
the card still in its old configuration leaves it pending instead of rejecting the node. Before, the release made
the node's check due at once and that judgement was `rejected` (mig_layout_mismatch / mig_not_configured)."""
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from marketplace.mig import layout_by_gpu
from marketplace.models import GpuModel, Instance, Node
from marketplace.services import instances as svc
from marketplace.services.nodes import node_update
from notifications.models import Notification
from provisioning.models import VerificationRun
from provisioning.services.mig import cards_awaiting
from provisioning.verification.mig import judge_mig
from provisioning.verification.model import DeclaredModel
from provisioning.verification.policy import judge
from tests.billing.helpers import fund
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.mig_helpers import make_mig_node
from tests.marketplace.renting_helpers import book, run

pytestmark = pytest.mark.django_db

CARD = {"name": "NVIDIA A100-SXM4-80GB", "memory_total_mib": 81920}


def _gpus(mig_on: set[int]) -> list[dict]:
    return [{"index": i, "uuid": f"GPU-{i}", "mig_mode": "Enabled" if i in mig_on else "Disabled", **CARD}
            for i in (0, 1)]


def _listed_check(node: Node, inventory: dict) -> None:
    """The check that listed the node, as stored (what the card's last judged configuration is read from)."""
    VerificationRun.objects.create(node=node, verdict="verified", inventory=inventory, figures={}, score=1.0,
                                   created_at=timezone.now() - timedelta(hours=1))


def _judged(node: Node, inventory: dict) -> str:
    node = Node.objects.get(pk=node.pk)
    declared = DeclaredModel.from_gpu_model(GpuModel.objects.get(slug="a100-80gb-sxm"))
    layout = layout_by_gpu(node.mig_layout)
    j = judge_mig(declared, layout, inventory, None, held={}, awaiting=cards_awaiting(node, layout))
    return judge(declared, 2, inventory["gpus"], None, mig=j).verdict


def _codes(node: Node, inventory: dict) -> list[str]:
    node = Node.objects.get(pk=node.pk)
    declared = DeclaredModel.from_gpu_model(GpuModel.objects.get(slug="a100-80gb-sxm"))
    layout = layout_by_gpu(node.mig_layout)
    j = judge_mig(declared, layout, inventory, None, held={}, awaiting=cards_awaiting(node, layout))
    return sorted(f.code for f in j.findings)


def _far_check(node: Node) -> None:
    Node.objects.filter(pk=node.pk).update(next_check_at=timezone.now() + timedelta(days=3))


def _told(node: Node, gpu: int) -> None:
    notice = Notification.objects.get(user=node.provider, kind="node_mig_layout_due")
    assert notice.payload["gpu"] == gpu and f"GPU {gpu} is free now" in notice.body


def test_stop_on_card_declared_anew_leaves_it_pending_withheld_and_the_provider_told():
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, gpu_count=2, prices={"3g.40gb": "0.25"})
    old = [{"gpu": 0, "device": n, "profile": "3g.40gb", "uuid": f"MIG-{n}"} for n in (0, 1)]
    _listed_check(node, {"gpus": _gpus({0}), "mig": old})
    renter = UserFactory()
    fund(renter, "50")
    inst = run(book(renter, node, mig_profile="3g.40gb"))
    _far_check(node)
    node_update(node=Node.objects.get(pk=node.pk), mig_layout=[{"gpu": 0, "profiles": ["7g.80gb"]}],
                mig_prices={"7g.80gb": Decimal("1.00")})
    svc.instance_stop(instance=inst)
    svc.instance_mark_stopped(instance_id=inst.pk)
    assert Node.objects.get(pk=node.pk).next_check_at > timezone.now(), "the stop queues no check"
    assert not node.mig_slices.filter(status="free").exists(), "the whole card is withheld, its free slice too"
    _told(node, 0)
    assert _judged(node, {"gpus": _gpus({0}), "mig": old}) == "verified"  # still the old split: pending
    new = [{"gpu": 0, "device": 0, "profile": "7g.80gb", "uuid": "MIG-7"}]
    # Re-split as declared: judged, its slice measured (unmeasured here; the sim check lists it:
    # test_round52_mig_layout_due), no longer pending.
    assert _codes(node, {"gpus": _gpus({0}), "mig": new}) == ["mig_slice_unproven"]
    wrong = [{"gpu": 0, "device": 0, "profile": "4g.40gb", "uuid": "MIG-4"}]
    assert _judged(node, {"gpus": _gpus({0}), "mig": wrong}) == "rejected"  # re-split otherwise: judged, wrong


def test_whole_card_declared_split_released_is_pending_withheld_and_the_provider_told():
    node = make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=2, runtime="docker")
    _listed_check(node, {"gpus": _gpus(set()), "mig": []})
    renter = UserFactory()
    fund(renter, "50")
    inst = run(book(renter, node))  # GPU 0 whole
    _far_check(node)
    node_update(node=Node.objects.get(pk=node.pk), mig_layout=[{"gpu": 0, "profiles": ["7g.80gb"]}],
                mig_prices={"7g.80gb": Decimal("1.00")})
    svc.instance_stop(instance=Instance.objects.get(pk=inst.pk))
    svc.instance_mark_stopped(instance_id=inst.pk)
    assert Node.objects.get(pk=node.pk).gpus.get(index=0).status == "mig"
    assert Node.objects.get(pk=node.pk).next_check_at > timezone.now(), "the release queues no check"
    _told(node, 0)
    assert _judged(node, {"gpus": _gpus(set()), "mig": []}) == "verified"


def test_a_card_declared_anew_that_nobody_rented_is_still_judged():
    """A free card the provider declared otherwise without re-splitting it: they could have; rejected as before."""
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, gpu_count=2, prices={"3g.40gb": "0.25"})
    old = [{"gpu": 0, "device": n, "profile": "3g.40gb", "uuid": f"MIG-{n}"} for n in (0, 1)]
    _listed_check(node, {"gpus": _gpus({0}), "mig": old})
    node_update(node=Node.objects.get(pk=node.pk), mig_layout=[{"gpu": 0, "profiles": ["7g.80gb"]}],
                mig_prices={"7g.80gb": Decimal("1.00")})
    assert _judged(node, {"gpus": _gpus({0}), "mig": old}) == "rejected"


def test_a_card_misconfigured_without_a_new_declaration_is_still_rejected():
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, gpu_count=2, prices={"3g.40gb": "0.25"})
    old = [{"gpu": 0, "device": n, "profile": "3g.40gb", "uuid": f"MIG-{n}"} for n in (0, 1)]
    _listed_check(node, {"gpus": _gpus({0}), "mig": old})
    renter = UserFactory()
    fund(renter, "50")
    inst = run(book(renter, node, mig_profile="3g.40gb"))
    svc.instance_stop(instance=inst)
    svc.instance_mark_stopped(instance_id=inst.pk)
    assert not Notification.objects.filter(kind="node_mig_layout_due").exists()
    assert node.mig_slices.filter(status="free").count() == 2, "nothing declared anew: both slices offered"
    wrong = [{"gpu": 0, "device": 0, "profile": "7g.80gb", "uuid": "MIG-7"}]
    assert _judged(node, {"gpus": _gpus({0}), "mig": wrong}) == "rejected"
