"""A MIG layout declared for a rented card (review r52, finding 1) becomes due when its last renter leaves: the
provider re-splits the card by hand, and only then can. The release no longer queues the node's check at once:
the provider is told the card is free and what to do, and the check (Verify now, or the periodic one) leaves the
card pending, withheld but not rejected, while the server still shows its old configuration. Before, the queued
check found the card in its old configuration and rejected the whole node: every GPU left the offers."""
import copy
from decimal import Decimal

import pytest

from core.errors import ApplicationError
from marketplace.models import Image, Instance, MigSlice, Node
from marketplace.services import instances as instance_svc
from marketplace.services.nodes import node_update
from notifications.models import Notification
from provisioning.models import OPEN_JOB_STATUSES, Job, JobKind
from provisioning.services.maintenance import nodes_reverify_due
from tests.factories import UserFactory
from tests.marketplace.renting_helpers import ed25519_key
from tests.provisioning.test_benchmark_verification import (
    profile_data,
    register,
    simbase,
    simnode,
    use_hardware,
    verify,
)

__all__ = ["simbase", "simnode"]

MIG_PROFILE = "a100-80gb-sxm-x2-mig"  # GPU 0 split 3g.40gb, 2g.20gb, 1g.10gb, 1g.10gb on the server; GPU 1 whole
OLD_SPLIT = ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
ALL_PRICES = {"3g.40gb": Decimal("0.25"), "2g.20gb": Decimal("0.25"), "1g.10gb": Decimal("0.25"),
              "7g.80gb": Decimal("1.00")}
SEVEN_G_UUID = "MIG-7a7a7a7a-0000-4000-8000-00000000000{}"


def _rent(node, num_gpus=1, **kw):
    inst, _ = instance_svc.instance_create(renter=UserFactory(), node_id=node.pk, num_gpus=num_gpus,
                                           image=Image.objects.filter(active=True).first(),
                                           ssh_public_keys=[ed25519_key()], **kw)
    instance_svc.instance_mark_provisioning(instance_id=inst.pk)
    return instance_svc.instance_mark_running(instance_id=inst.pk, ssh_host="127.0.0.1", ssh_port=40001,
                                              ssh_user="root")


def _leave(inst, capture) -> None:
    with capture(execute=True):
        instance_svc.instance_destroy(instance=Instance.objects.get(pk=inst.pk))
        instance_svc.instance_mark_destroyed(instance_id=inst.pk)


def _bookable(node, **kw) -> bool:
    try:
        instance_svc.instance_create(renter=UserFactory(), node_id=node.pk, num_gpus=1,
                                     image=Image.objects.filter(active=True).first(),
                                     ssh_public_keys=[ed25519_key()], **kw)
    except ApplicationError:
        return False
    return True


def _nothing_queued(node) -> None:
    """The release queues no check: the beat finds none due, no verification is open."""
    nodes_reverify_due()
    assert not Job.objects.filter(node=node, kind=JobKind.NODE_VERIFY, status__in=OPEN_JOB_STATUSES).exists()


def _told(node, gpu: int) -> Notification:
    notice = Notification.objects.get(user=node.provider, kind="node_mig_layout_due")
    assert notice.payload["gpu"] == gpu
    assert f"GPU {gpu} is free now" in notice.body and "Verify now" in notice.body
    return notice


def _split(simnode, gpu: int) -> None:
    """The provider turns MIG on for `gpu` (if off) and makes it one 7g.80gb instance (what the sim server shows)."""
    data = copy.deepcopy(profile_data(MIG_PROFILE))
    data["nvidia_smi"][gpu] = data["nvidia_smi"][gpu].replace("Disabled, Enabled", "Enabled, Enabled")
    data["mig"][str(gpu)] = [{"profile": "7g.80gb", "uuid": SEVEN_G_UUID.format(gpu), "compute_slices": 7,
                              "memory_mib": 80896}]
    use_hardware(simnode, data)


@pytest.mark.slow
def test_a_card_resplit_while_rented_is_pending_not_rejected_after_its_renter_leaves(
        db, simnode, simbase, settings, django_capture_on_commit_callbacks):
    settings.BILLING_REQUIRE_FUNDS = False
    node = register(simnode, simbase, MIG_PROFILE)
    node, _ = verify(node)
    assert node.verdict == "verified", node.last_error
    sliced = _rent(node, 1, mig_profile="3g.40gb")  # GPU 0's 3g slice
    node_update(node=Node.objects.get(pk=node.pk), mig_layout=[{"gpu": 0, "profiles": ["7g.80gb"]}],
                mig_prices={"7g.80gb": Decimal("1.00")})
    _leave(sliced, django_capture_on_commit_callbacks)
    _nothing_queued(node)
    _told(node, 0)
    assert not node.mig_slices.filter(gpu__index=0, status="free").exists(), "GPU 0 is withheld whole"
    # The periodic check (or Verify now) runs before the provider re-split it: the server shows the old split.
    node, job = verify(node)
    assert node.verdict == "verified", node.last_error
    assert job.status == "succeeded"
    assert not node.mig_slices.filter(gpu__index=0, status="free").exists(), "GPU 0 stays withheld"
    assert node.gpus.get(index=0).status == "mig"
    assert _bookable(node), "GPU 1 stays listed"
    assert not _bookable(node, mig_profile="3g.40gb")
    # The provider re-splits GPU 0 as declared and presses Verify now: the new slice is listed.
    _split(simnode, 0)
    node, _ = verify(node)
    assert node.verdict == "verified", node.last_error
    assert MigSlice.objects.filter(node=node, gpu__index=0, profile="7g.80gb", status="free").count() == 1
    assert _bookable(node, mig_profile="7g.80gb")


@pytest.mark.slow
def test_a_whole_card_declared_split_while_rented_is_pending_not_rejected_after_its_renter_leaves(
        db, simnode, simbase, settings, django_capture_on_commit_callbacks):
    settings.BILLING_REQUIRE_FUNDS = False
    node = register(simnode, simbase, MIG_PROFILE)
    node, _ = verify(node)
    whole = _rent(node, 1)  # GPU 1 whole
    node_update(node=Node.objects.get(pk=node.pk),
                mig_layout=[{"gpu": 0, "profiles": OLD_SPLIT}, {"gpu": 1, "profiles": ["7g.80gb"]}],
                mig_prices=ALL_PRICES)
    _leave(whole, django_capture_on_commit_callbacks)
    _nothing_queued(node)
    _told(node, 1)
    node, _ = verify(node)  # MIG mode still off on GPU 1
    assert node.verdict == "verified", node.last_error
    assert node.gpus.get(index=1).status == "mig", "declared split: not booked whole meanwhile"
    assert not _bookable(node)
    assert _bookable(node, mig_profile="3g.40gb"), "GPU 0's slices stay listed"
    _split(simnode, 1)
    node, _ = verify(node)
    assert node.verdict == "verified", node.last_error
    assert MigSlice.objects.filter(node=node, gpu__index=1, profile="7g.80gb", status="free").count() == 1


@pytest.mark.slow
def test_a_card_declared_whole_again_stays_out_of_whole_booking_until_mig_mode_is_off(
        db, simnode, simbase, settings, django_capture_on_commit_callbacks):
    settings.BILLING_REQUIRE_FUNDS = False
    node = register(simnode, simbase, MIG_PROFILE)
    node, _ = verify(node)
    sliced = _rent(node, 1, mig_profile="3g.40gb")
    node_update(node=Node.objects.get(pk=node.pk), mig_layout=[], mig_prices={})
    _leave(sliced, django_capture_on_commit_callbacks)
    _nothing_queued(node)
    _told(node, 0)
    node, _ = verify(node)  # GPU 0 still split on the server
    assert node.verdict == "verified", node.last_error
    assert node.gpus.get(index=0).status == "mig", "still in MIG mode on the server: not offered whole"
    assert not node.mig_slices.filter(status="free").exists()


@pytest.mark.slow
def test_a_card_misconfigured_without_a_new_declaration_is_still_rejected(db, simnode, simbase):
    node = register(simnode, simbase, MIG_PROFILE)
    node, _ = verify(node)
    assert node.verdict == "verified", node.last_error
    _split(simnode, 0)  # GPU 0 re-split to 7g.80gb on the server, the declaration unchanged
    node, _ = verify(node)
    assert node.verdict == "rejected"
    assert "mig_layout_mismatch" in node.benchmark_summary["findings"]
    node, _ = verify(node)  # and again: a rejected check is no layout judged
    assert node.verdict == "rejected"
