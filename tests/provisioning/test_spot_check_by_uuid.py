"""The cards a re-check tests are found by their UUID in what nvidia-smi answers now, not by the index the platform
stored at the last verification. nvidia-smi may number the cards anew (a reboot, a card moved to another slot), and
the health checks, which compare UUIDs only, do not renumber the rows. Before, a spot check challenged the stored
indices of the free cards: after a renumbering, the rented card (its renter's GPU loaded with the challenge and the
memory proof) instead of the free one, whose faults went unseen; and a full verification left out of its benchmark
the free card now answering at a rented card's old index, so a free card with wrong results stayed listed."""
import copy

from marketplace.models import Gpu, GpuAllocation
from provisioning.models import Job, JobKind, JobStatus, NodeEvent
from provisioning.services.runner import job_begin
from provisioning.services.verification import node_verify_request, node_verify_run
from tests.provisioning.test_benchmark_verification import (
    profile_data,
    register,
    rent,
    simbase,
    simnode,
    use_hardware,
    verify,
)
from tests.provisioning.test_random_rechecks import bounds, spot_check

__all__ = ["bounds", "simbase", "simnode"]  # fixtures


def renumbered_with_free_card_broken(rented_uuid: str) -> dict:
    """rtx-a4000-x2 after a reboot that swapped nvidia-smi's numbering of its two cards: the rented card (UUID
    `rented_uuid`, GPU 0 before) answers as GPU 1 and the free one as GPU 0; the free card now returns wrong matrix
    products, and a shim makes its own correctness check say it is fine (only the platform's challenge sees it)."""
    data = copy.deepcopy(profile_data("rtx-a4000-x2"))
    lines = data["nvidia_smi"]
    assert rented_uuid in lines[0]  # the renter holds the card that was GPU 0
    swapped = [lines[1], lines[0]]
    data["nvidia_smi"] = [f"{i},{line.split(',', 1)[1]}" for i, line in enumerate(swapped)]
    first, second = data["performance"]["gpus"]
    data["performance"]["gpus"] = [{**second, "index": 0, "matmul_correct": False}, {**first, "index": 1}]
    data["performance"]["fake_correct"] = True
    return data


def _renumbered_node(simnode, simbase):
    node, _ = verify(register(simnode, simbase, "rtx-a4000-x2"))
    assert node.verdict == "verified"
    instance = rent(node)
    card = GpuAllocation.objects.get(instance=instance, released_at__isnull=True).gpu
    assert card.index == 0
    free = Gpu.objects.get(node=node, index=1)
    use_hardware(simnode, renumbered_with_free_card_broken(card.uuid))
    return node, card, free


def test_a_spot_check_challenges_the_free_card_where_nvidia_smi_numbers_it_now(db, simnode, simbase, bounds):
    node, rented_card, free_card = _renumbered_node(simnode, simbase)
    job = spot_check(node)
    assert job.status == JobStatus.SUCCEEDED
    challenged = [m["message"] for m in job.log if m["message"].startswith("challenging GPU")]
    assert challenged and challenged[0].startswith("challenging GPU 0 "), challenged  # the free card, now GPU 0
    event = NodeEvent.objects.get(node=node, kind="spot_check_failed")
    assert "challenge_wrong_result" in event.message
    assert Job.objects.filter(node=node, kind=JobKind.NODE_VERIFY, status=JobStatus.QUEUED).exists()


def test_a_verification_benchmarks_the_free_card_answering_at_a_rented_cards_old_index(db, simnode, simbase,
                                                                                     bounds):
    node, rented_card, free_card = _renumbered_node(simnode, simbase)
    run_before = node.verifications.count()
    job = job_begin(job_id=node_verify_request(node=node, reason="by hand").pk)
    node_verify_run(job=job)
    job.refresh_from_db()
    node.refresh_from_db()
    assert node.verifications.count() == run_before + 1
    assert [m["message"] for m in job.log if m["message"].startswith("benchmarking GPU 0 ")], job.log
    run = node.verifications.order_by("-created_at", "-pk").first()
    assert ("challenge_wrong_result", 0) in {(f["code"], f["gpu_index"]) for f in run.findings}, run.findings
    assert node.verdict == "rejected"
    # The renter's card (GPU 1 now) was left alone, and no finding names it.
    assert not [m for m in job.log if "GPU 1" in m["message"] and m["message"].startswith("benchmarking")]
    assert Gpu.objects.get(pk=rented_card.pk).index == 1 and Gpu.objects.get(pk=free_card.pk).index == 0
