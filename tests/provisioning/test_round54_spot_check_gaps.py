"""Review r54 ("spot") #6: spot-check gaps drawn uniformly between 6 and 42 h promised 6 quiet hours after every spot
check (an SSH login and a challenge the provider sees): time to use the "idle" cards elsewhere. The gaps are now a
small floor plus an exponential, memoryless gap (at most a cap), with about the same mean load per node."""
import math
from datetime import timedelta
from statistics import fmean

from django.utils import timezone

from marketplace.models import NodeState
from provisioning.services.verification import draw_spot_gap, exponential_scale, node_draw_next_checks
from tests.factories import make_node

HOUR = 3600


def _gaps(n):
    return [draw_spot_gap().total_seconds() for _ in range(n)]


def test_a_spot_check_just_ended_promises_no_quiet_hours(settings):
    settings.SPOT_CHECK_MIN_S, settings.SPOT_CHECK_MEAN_S, settings.SPOT_CHECK_MAX_S = 15 * 60, 24 * HOUR, 72 * HOUR
    gaps = _gaps(20000)
    assert all(15 * 60 <= g <= 72 * HOUR for g in gaps)
    assert abs(fmean(gaps) - 24 * HOUR) < 0.5 * HOUR  # the same load per node as the uniform 6-42 h (its mean 24 h)
    # A check within the hour after one: about 3 % (before: never within 6 h).
    soon = sum(g <= HOUR for g in gaps) / len(gaps)
    assert 0.015 < soon < 0.06, soon
    # Memoryless: 6 quiet hours passed say nothing; the chance of a check in the next hour is the same.
    later = [g for g in gaps if g > 6 * HOUR]
    assert abs(sum(g <= 7 * HOUR for g in later) / len(later) - soon) < 0.02


def test_the_next_spot_check_is_drawn_so_when_a_verification_ends(db, settings):
    settings.SPOT_CHECK_MIN_S, settings.SPOT_CHECK_MEAN_S, settings.SPOT_CHECK_MAX_S = 15 * 60, 24 * HOUR, 72 * HOUR
    node, now = make_node(state=NodeState.ACTIVE, verdict="verified"), timezone.now()
    gaps = []
    for _ in range(3000):
        node_draw_next_checks(node, now=now)
        gaps.append((node.next_spot_check_at - now).total_seconds())
    assert min(gaps) < 2 * HOUR and max(gaps) > 48 * HOUR
    assert abs(fmean(gaps) - 24 * HOUR) < 1.5 * HOUR


def test_the_scale_makes_the_cut_exponential_keep_its_mean(settings):
    for mean, cap in ((23.75, 71.75), (18, 36), (1, 1000), (99, 100)):
        scale = exponential_scale(mean, cap)
        assert math.isclose(scale * -math.expm1(-cap / scale), mean, rel_tol=1e-6) or mean >= cap * 0.99
    settings.SPOT_CHECK_MIN_S, settings.SPOT_CHECK_MEAN_S, settings.SPOT_CHECK_MAX_S = HOUR, HOUR, 2 * HOUR
    assert draw_spot_gap() == timedelta(seconds=HOUR)  # a mean at the floor: the floor
