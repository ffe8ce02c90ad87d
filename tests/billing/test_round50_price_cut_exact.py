"""A re-check measuring a node worse cuts its renters' prices in proportion to the score, and a later one raises them
back: the published rule is price × score now / score before, rounded down once to the micro-dollar (found by
review: the float quotient, 41 / 80 = 0.51249999…, truncated with the price took a micro-dollar off the rule's price
for ordinary prices and scores, on every hour billed after)."""
from datetime import timedelta
from fractions import Fraction

import pytest

from marketplace.models import Instance, Node
from marketplace.services.instances import score_share
from provisioning.models import Job, JobKind
from provisioning.services.verification import node_verify_conclude
from tests.billing.helpers import fund, node, running
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def _check(host, verdict, score):
    job = Job.objects.create(kind=JobKind.NODE_VERIFY, node=host, status="running",
                             deadline=host.created_at + timedelta(days=1))
    node_verify_conclude(job=job, verdict=verdict, score=score, inventory={},
                         findings=[{"severity": "degrade", "code": "bf16_slow", "message": "slow", "gpu_index": 1}])


def _renting(price: str, score: float):
    host = node(price=price, gpu_count=2)
    Node.objects.filter(pk=host.pk).update(score=score)
    renter = UserFactory()
    fund(renter, "50")
    return host, running(renter, host, num_gpus=1)


@pytest.mark.parametrize(("price", "before", "now", "expected_per_gpu"), [
    ("1.000000", 80.0, 41.0, 512_500),  # $1.00 × 41/80 = $0.5125 exactly
    ("1.500000", 80.0, 23.0, 431_250),  # $1.50 × 23/80 = $0.43125 exactly
    ("1.500000", 90.0, 30.0, 500_000),  # $1.50 × 1/3 = $0.50 exactly; the float third is a hair under
    ("1.000000", 90.0, 29.5, 327_777),  # $1.00 × 29.5/90 = $0.3277…: rounded down once
])
def test_a_price_cut_is_the_exact_share_rounded_down_once(clock, price, before, now, expected_per_gpu):
    host, instance = _renting(price, before)
    _check(host, "degraded", now)
    instance = Instance.objects.get(pk=instance.pk)
    assert instance.price_before_cut_per_gpu_hour_micros is not None  # it was cut
    assert instance.price_per_gpu_hour_micros == expected_per_gpu


def test_a_raise_back_is_the_exact_share_of_the_price_before_the_cut(clock):
    host, instance = _renting("1.000000", 80.0)
    _check(host, "degraded", 20.0)
    assert Instance.objects.get(pk=instance.pk).price_per_gpu_hour_micros == 250_000
    clock.advance(60)
    _check(host, "degraded", 41.0)
    assert Instance.objects.get(pk=instance.pk).price_per_gpu_hour_micros == 512_500


def test_score_share_is_exact_on_the_scores_as_written():
    assert score_share(41.0, 80.0) == Fraction(41, 80)
    assert score_share(29.5, 90.0) == Fraction(59, 180)
    assert score_share(0.1, 0.3) == Fraction(1, 3)
