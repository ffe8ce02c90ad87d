"""A MIG layout that waited for a card's renter (test_round47_mig_pending_layout) is applied once the renter leaves:
the card is not offered in its old form meanwhile, and the provider's Verify now, once they configured the card as
declared, applies the declaration (since r52 the release queues no check: one run before the provider could re-split
the card rejected the node; test_round52_mig_layout_due). Before, a card held whole and declared split went back
`free` on release (bookable whole), a slice on a card declared whole again came back `free`, and nothing judged
the declaration until the periodic check, days later."""
import copy
from decimal import Decimal

import pytest
from django.utils import timezone

from core.errors import ApplicationError
from marketplace.models import Image, Instance, MigSlice, Node
from marketplace.services import instances as instance_svc
from marketplace.services.nodes import node_update
from provisioning.models import OPEN_JOB_STATUSES, Job, JobKind
from provisioning.services.maintenance import nodes_reverify_due
from provisioning.services.runner import job_begin
from provisioning.services.verification import node_verify_request, node_verify_run
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


def _book(node, num_gpus=1, **kw):
    inst, _ = instance_svc.instance_create(renter=UserFactory(), node_id=node.pk, num_gpus=num_gpus,
                                           image=Image.objects.filter(active=True).first(),
                                           ssh_public_keys=[ed25519_key()], **kw)
    return inst


def _rent(node, num_gpus=1, **kw):
    inst = _book(node, num_gpus, **kw)
    instance_svc.instance_mark_provisioning(instance_id=inst.pk)
    return instance_svc.instance_mark_running(instance_id=inst.pk, ssh_host="127.0.0.1", ssh_port=40001,
                                              ssh_user="root")


def _leave(inst, capture) -> None:
    """The renter destroys the instance; the node's worker confirms it (the release commits)."""
    with capture(execute=True):
        instance_svc.instance_destroy(instance=Instance.objects.get(pk=inst.pk))
        instance_svc.instance_mark_destroyed(instance_id=inst.pk)


def _bookable(node, **kw) -> bool:
    try:
        _book(node, 1, **kw)
    except ApplicationError:
        return False
    return True


def _open_verification(node) -> Job | None:
    return Job.objects.filter(node=node, kind=JobKind.NODE_VERIFY, status__in=OPEN_JOB_STATUSES).first()


def _verify_now(node) -> Job:
    """The release queued nothing; the provider presses Verify now once the card is configured as declared."""
    assert Node.objects.get(pk=node.pk).next_check_at > timezone.now(), "the release makes no check due"
    nodes_reverify_due()
    assert _open_verification(node) is None
    return node_verify_request(node=Node.objects.get(pk=node.pk))


def _run(job: Job, node) -> Node:
    node_verify_run(job=job_begin(job_id=job.pk))
    return Node.objects.get(pk=node.pk)


def _split_gpu1(simnode) -> None:
    """The provider turns MIG on for GPU 1 and creates one 7g.80gb instance on it (what the sim server then shows)."""
    data = copy.deepcopy(profile_data(MIG_PROFILE))
    data["nvidia_smi"][1] = data["nvidia_smi"][1].replace("Disabled, Enabled", "Enabled, Enabled")
    data["mig"]["1"] = [{"profile": "7g.80gb", "uuid": "MIG-7a7a7a7a-0000-4000-8000-000000000001",
                         "compute_slices": 7, "memory_mib": 80896}]
    use_hardware(simnode, data)


def _whole_gpu0(simnode) -> None:
    """The provider turns MIG off on GPU 0: both cards whole on the server."""
    data = copy.deepcopy(profile_data(MIG_PROFILE))
    data["nvidia_smi"][0] = data["nvidia_smi"][0].replace("Enabled, Enabled", "Disabled, Enabled")
    data["mig"] = {}
    data["declared"]["mig_layout"] = []
    use_hardware(simnode, data)


@pytest.mark.slow
def test_a_whole_card_declared_split_is_not_booked_whole_after_its_renter_leaves(
        db, simnode, simbase, settings, django_capture_on_commit_callbacks):
    settings.BILLING_REQUIRE_FUNDS = False
    node = register(simnode, simbase, MIG_PROFILE)
    node, _ = verify(node)
    whole = _rent(node, 1)  # GPU 1 whole
    node_update(node=Node.objects.get(pk=node.pk),
                mig_layout=[{"gpu": 0, "profiles": OLD_SPLIT}, {"gpu": 1, "profiles": ["7g.80gb"]}],
                mig_prices=ALL_PRICES)
    node, _ = verify(node)
    assert node.verdict == "verified", node.last_error
    assert _open_verification(node) is None
    _leave(whole, django_capture_on_commit_callbacks)
    gpu1 = node.gpus.get(index=1)
    assert gpu1.status != "free", "GPU 1 is declared split: not offered whole again"
    assert not _bookable(node)  # GPU 0 is split, GPU 1 declared split: no whole GPU to book
    job = _verify_now(node)
    _split_gpu1(simnode)  # the provider applies the declaration now that the card is free
    node = _run(job, node)
    assert node.verdict == "verified", node.last_error
    assert node.gpus.get(index=1).status == "mig"
    assert MigSlice.objects.filter(node=node, gpu__index=1, profile="7g.80gb", status="free").count() == 1
    assert _bookable(node, mig_profile="7g.80gb")


@pytest.mark.slow
def test_a_slice_of_a_card_declared_whole_again_does_not_come_back_free(
        db, simnode, simbase, settings, django_capture_on_commit_callbacks):
    settings.BILLING_REQUIRE_FUNDS = False
    node = register(simnode, simbase, MIG_PROFILE)
    node, _ = verify(node)
    sliced = _rent(node, 1, mig_profile="3g.40gb")  # GPU 0's 3g slice
    node_update(node=Node.objects.get(pk=node.pk), mig_layout=[], mig_prices={})
    node, _ = verify(node)
    assert node.verdict == "verified", node.last_error
    assert _open_verification(node) is None
    _leave(sliced, django_capture_on_commit_callbacks)
    assert not node.mig_slices.filter(status="free").exists(), "GPU 0 is declared whole: its slices not offered"
    job = _verify_now(node)
    _whole_gpu0(simnode)
    node = _run(job, node)
    assert node.verdict == "verified", node.last_error
    assert node.gpus.get(index=0).status == "free"
    assert _bookable(node)
