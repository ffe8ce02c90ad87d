"""A re-check benchmarks the free cards only; the score it cuts renters' prices by is compared with what the
check that listed the node gave those same cards (by UUID), not with that check's score over all the cards. Cards
of one node differ by up to 10 % before `gpu_outlier` flags one: before, a re-check that measured only the slower
free cards, unchanged, read as the node measured worse and cut the renters of the faster ones (6.8 % here) though
no card was any slower than when the node was listed. The same cards measured slower still cut, by their own
ratio."""
from fractions import Fraction

import pytest

from marketplace.models import Gpu, Instance
from provisioning.models import VerificationRun
from provisioning.services.runner import job_begin
from provisioning.services.verification import node_verify_conclude, node_verify_request
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book, run, sent_jobs_fixture  # noqa: F401 (the sent_jobs fixture)

pytestmark = pytest.mark.django_db
LISTED = {"GPU-a": 110.0, "GPU-b": 110.0, "GPU-c": 96.0, "GPU-d": 96.0}  # C and D 6.8 % under the median: no outlier


def _node_listed_with_fast_cards_rented():
    node = make_listed_node(gpu_count=4)
    for gpu, uuid in zip(Gpu.objects.filter(node=node).order_by("index"), LISTED, strict=True):
        Gpu.objects.filter(pk=gpu.pk).update(uuid=uuid)
    VerificationRun.objects.create(node=node, verdict="verified", score=103.0, figures={"gpus": [
        {"index": i, "uuid": uuid, "score": score} for i, (uuid, score) in enumerate(LISTED.items())]})
    instance = run(book(UserFactory(), node, num_gpus=2))  # the first free cards: GPU-a and GPU-b
    held = set(Gpu.objects.filter(allocations__instance=instance, allocations__released_at__isnull=True)
               .values_list("uuid", flat=True))
    assert held == {"GPU-a", "GPU-b"}
    return node, instance


def _recheck(node, measured: dict[str, float]) -> Instance:
    """The re-check's conclusion: the free cards C and D measured (A and B rented: not benchmarked)."""
    score = round(sum(measured.values()) / len(measured), 2)
    job = job_begin(job_id=node_verify_request(node=node).pk)
    node_verify_conclude(job=job, verdict="verified", findings=[], inventory={}, score=score, figures={
        "gpus": [{"index": 2 + i, "uuid": uuid, "score": s} for i, (uuid, s) in enumerate(measured.items())]})
    return Instance.objects.get(node=node)


def test_free_cards_measured_as_they_were_cut_no_renter(sent_jobs):
    node, instance = _node_listed_with_fast_cards_rented()
    price = instance.price_per_hour_micros
    assert _recheck(node, {"GPU-c": 96.0, "GPU-d": 96.0}).price_per_hour_micros == price


def test_the_same_cards_measured_slower_cut_by_their_own_ratio(sent_jobs):
    node, instance = _node_listed_with_fast_cards_rented()
    price = instance.price_per_hour_micros
    after = _recheck(node, {"GPU-c": 80.0, "GPU-d": 80.0}).price_per_hour_micros
    assert after == int(price * Fraction(80) / Fraction(96))
