"""A stopped instance on a card whose provider declared another MIG layout (the layout waited for its renters:
verification.mig.pending_layout). A stop frees an instance's GPUs on any card (instance_mark_stopped releases
them; another booking may take them, and the start then refuses or, a VM, moves): it keeps no claim, so a
pending layout is applied once the last renter has stopped, as once they have destroyed. The renter's start is
then refused; before, the refusal said "in use by another instance now or no longer listed; try again later" for
a slice nobody holds and that never comes back. Now it says the card was declared anew, and that destroying is
the way on; a slice another renter holds still says "try again later"."""
from decimal import Decimal

import pytest

from core.errors import Conflict
from marketplace.models import Gpu, GpuStatus, Instance, MigSlice, Node, SliceStatus
from marketplace.services import instances as svc
from marketplace.services.nodes import node_update
from tests.billing.helpers import fund
from tests.factories import UserFactory

from .mig_helpers import make_mig_node
from .renting_helpers import book, run

pytestmark = pytest.mark.django_db

PRICES = {"7g.80gb": Decimal("1.00")}


def _renter():
    user = UserFactory()
    fund(user, "50")
    return user


def _stopped(instance) -> Instance:
    svc.instance_stop(instance=instance)
    return svc.instance_mark_stopped(instance_id=instance.pk)


def _start_refusal(instance) -> str:
    with pytest.raises(Conflict) as refused:
        svc.instance_start(instance=Instance.objects.get(pk=instance.pk))
    return str(refused.value)


def test_a_stopped_slice_renter_on_a_card_declared_anew_is_told_it_was_resplit_not_to_try_later():
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, gpu_count=1, prices={"3g.40gb": "0.25"})
    instance = run(book(_renter(), node, mig_profile="3g.40gb"))
    node_update(node=Node.objects.get(pk=node.pk), mig_layout=[{"gpu": 0, "profiles": ["7g.80gb"]}],
                mig_prices=PRICES)
    _stopped(instance)
    # The stop freed the card as any stop does: its slice is held out of the offers for the declared layout.
    assert set(MigSlice.objects.filter(node=node).values_list("status", flat=True)) <= {SliceStatus.FREE,
                                                                                      SliceStatus.UNAVAILABLE}
    said = _start_refusal(instance)
    assert "MIG slices" in said
    assert "declared a new MIG layout for GPU 0" in said, said
    assert "try again later" not in said, said
    assert "destroy" in said
    assert not MigSlice.objects.filter(node=node, status=SliceStatus.RENTED).exists()


def test_a_stopped_slice_renter_on_a_card_declared_whole_again_is_told_so():
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, gpu_count=2, prices={"3g.40gb": "0.25"})
    instance = run(book(_renter(), node, mig_profile="3g.40gb"))
    node_update(node=Node.objects.get(pk=node.pk), mig_layout=[], mig_prices={})
    _stopped(instance)
    said = _start_refusal(instance)
    assert "declared GPU 0 whole again" in said, said
    assert "try again later" not in said, said


def test_a_stopped_slice_renters_slice_taken_by_another_renter_still_says_try_later():
    node = make_mig_node({0: ["3g.40gb"]}, gpu_count=1, prices={"3g.40gb": "0.25"})
    instance = run(book(_renter(), node, mig_profile="3g.40gb"))
    _stopped(instance)
    run(book(_renter(), node, mig_profile="3g.40gb"))  # the layout is unchanged: the freed slice is booked again
    said = _start_refusal(instance)
    assert "in use by another instance" in said and "try again later" in said, said


def test_a_stopped_whole_gpu_container_on_a_card_declared_split_is_told_it_is_split():
    """The whole-card case already said why (its container's own GPUs: _container_gpus_refusal)."""
    node = make_mig_node({}, gpu_count=1, runtime="docker", prices={})
    instance = run(book(_renter(), node))
    node_update(node=Node.objects.get(pk=node.pk), mig_layout=[{"gpu": 0, "profiles": ["7g.80gb"]}],
                mig_prices={"7g.80gb": Decimal("1.00")})
    _stopped(instance)
    assert Gpu.objects.get(node=node, index=0).status == GpuStatus.MIG
    assert "GPU 0 is split into MIG slices now" in _start_refusal(instance)
