"""A re-check benchmarks the free cards only, so two re-checks of one node may measure different cards. A cut
compares the cards it measured with the scores the listed check gave those same cards (test_recheck_cut_same_cards);
the raise back compares the same cards too: the ones the cut compared, now against their scores before the cut, and
only once the re-check measured the ones that caused it. Before, it compared this check's score over whatever cards
it measured with the score before the cut: a re-check of the fast free cards only raised the price back in full
though the slow card (rented meanwhile) was never measured again, and a re-check of the repaired card with slower
others kept part of the cut. Never above the price the renter booked at (the provider's asking price then)."""
from fractions import Fraction

import pytest

from billing.models import BillingEvent, EventKind
from marketplace.models import Gpu, Instance
from provisioning.models import VerificationRun
from provisioning.services.runner import job_begin
from provisioning.services.verification import node_verify_conclude, node_verify_request
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book, run, sent_jobs_fixture  # noqa: F401 (the sent_jobs fixture)

pytestmark = pytest.mark.django_db
EVEN = {"GPU-a": 100.0, "GPU-b": 100.0, "GPU-c": 100.0, "GPU-d": 100.0}


def _listed(cards: dict[str, float]):
    """A node listed by a check that scored these cards (by index, in this order); its renter holds GPU-a."""
    node = make_listed_node(gpu_count=len(cards))
    for gpu, uuid in zip(Gpu.objects.filter(node=node).order_by("index"), cards, strict=True):
        Gpu.objects.filter(pk=gpu.pk).update(uuid=uuid)
    VerificationRun.objects.create(node=node, verdict="verified", score=round(sum(cards.values()) / len(cards), 2),
                                   figures={"gpus": [{"index": i, "uuid": uuid, "score": score}
                                                     for i, (uuid, score) in enumerate(cards.items())]})
    instance = run(book(UserFactory(), node, num_gpus=1))
    assert set(Gpu.objects.filter(allocations__instance=instance, allocations__released_at__isnull=True)
               .values_list("uuid", flat=True)) == {"GPU-a"}
    return node, instance


def _recheck(node, measured: dict[str, float], verdict: str = "verified") -> None:
    """A re-check's conclusion that measured these (free) cards."""
    factor = {"verified": 1.0, "degraded": 0.8}[verdict]
    index = {uuid: i for i, uuid in enumerate(Gpu.objects.filter(node=node).order_by("index")
                                              .values_list("uuid", flat=True))}
    score = round(sum(measured.values()) / len(measured) * factor, 2)
    job = job_begin(job_id=node_verify_request(node=node).pk)
    node_verify_conclude(job=job, verdict=verdict, findings=[], inventory={}, score=score, figures={
        "gpus": [{"index": index[uuid], "uuid": uuid, "score": s} for uuid, s in measured.items()]})


def _price(instance) -> int:
    return Instance.objects.get(pk=instance.pk).price_per_hour_micros


def test_a_recheck_of_the_fast_cards_alone_raises_nothing_back(sent_jobs):
    node, instance = _listed(EVEN)
    booked = instance.price_per_hour_micros
    _recheck(node, {"GPU-b": 40.0, "GPU-c": 100.0, "GPU-d": 100.0})  # B slow: the node measured 80 %
    assert _price(instance) == int(booked * Fraction(8, 10))
    later = run(book(UserFactory(), node, num_gpus=1))  # rents the slow free card, B: never measured again
    _recheck(node, {"GPU-c": 100.0, "GPU-d": 100.0})
    assert _price(instance) == int(booked * Fraction(8, 10))
    assert _price(later) == later.price_per_hour_micros  # booked after the cut: never cut, never raised


def test_the_cut_card_measured_better_raises_by_the_same_cards(sent_jobs):
    node, instance = _listed(EVEN)
    booked = instance.price_per_hour_micros
    _recheck(node, {"GPU-b": 40.0, "GPU-c": 100.0, "GPU-d": 100.0})
    # B better, not yet as it was (C measured, D not: as the cut measured it): (70 + 100 + 100) / 300.
    _recheck(node, {"GPU-b": 70.0, "GPU-c": 100.0})
    assert _price(instance) == int(booked * Fraction(9, 10))
    _recheck(node, {"GPU-c": 100.0, "GPU-d": 100.0})  # B not measured: the partial raise stays
    assert _price(instance) == int(booked * Fraction(9, 10))
    _recheck(node, {"GPU-b": 100.0})
    assert _price(instance) == booked
    assert Instance.objects.get(pk=instance.pk).price_before_cut_per_gpu_hour_micros is None


def test_the_repaired_card_with_slower_ones_raises_in_full(sent_jobs):
    # C and D 13 % under A and B, no outlier; only B measured by the check that cut (C and D rented then).
    node, instance = _listed({"GPU-a": 110.0, "GPU-b": 110.0, "GPU-c": 96.0, "GPU-d": 96.0})
    booked = instance.price_per_hour_micros
    _recheck(node, {"GPU-b": 88.0})
    assert _price(instance) == int(booked * Fraction(88, 110))
    _recheck(node, {"GPU-b": 110.0, "GPU-c": 96.0, "GPU-d": 96.0})  # B as it was; C and D as they always were
    assert _price(instance) == booked


def test_a_new_cut_after_a_full_raise_is_raised_by_its_own_cards(sent_jobs):
    node, instance = _listed(EVEN)
    booked = instance.price_per_hour_micros
    _recheck(node, {"GPU-b": 40.0, "GPU-c": 100.0, "GPU-d": 100.0})
    _recheck(node, {"GPU-b": 100.0, "GPU-c": 100.0, "GPU-d": 100.0})
    assert _price(instance) == booked
    _recheck(node, {"GPU-c": 40.0, "GPU-d": 100.0})  # now C slow (B rented): 70 %
    assert _price(instance) == int(booked * Fraction(7, 10))
    _recheck(node, {"GPU-b": 100.0, "GPU-d": 100.0})  # B was the first cut's, not this one's: C not measured
    assert _price(instance) == int(booked * Fraction(7, 10))
    _recheck(node, {"GPU-c": 100.0})
    assert _price(instance) == booked


def test_a_raise_never_exceeds_the_price_booked(sent_jobs):
    node, instance = _listed(EVEN)
    booked, per_gpu = instance.price_per_hour_micros, instance.price_per_gpu_hour_micros
    _recheck(node, {"GPU-b": 40.0, "GPU-c": 100.0, "GPU-d": 100.0})
    _recheck(node, {"GPU-b": 150.0, "GPU-c": 150.0, "GPU-d": 150.0})  # faster than ever
    after = Instance.objects.get(pk=instance.pk)
    assert (after.price_per_hour_micros, after.price_per_gpu_hour_micros) == (booked, per_gpu)
    raise_event = BillingEvent.objects.filter(kind=EventKind.PRICE_RAISED_BACK, data__instance=instance.pk).get()
    assert raise_event.data["ratio"] == 1


def test_the_verdict_factor_counts_on_both_sides(sent_jobs):
    node, instance = _listed(EVEN)
    booked = instance.price_per_hour_micros
    _recheck(node, {"GPU-b": 40.0, "GPU-c": 100.0, "GPU-d": 100.0})
    # B as it was, but the node degraded (its score × 0.8): 80 % of the price before the cut, no more.
    _recheck(node, {"GPU-b": 100.0, "GPU-c": 100.0, "GPU-d": 100.0}, verdict="degraded")
    assert _price(instance) == int(booked * Fraction(8, 10))
