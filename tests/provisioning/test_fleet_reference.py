"""A GPU model's fleet reference (provisioning.selectors.fleet_reference): which nodes' runs it is built from, the
setting that turns it on, and the verification service judging a node against it."""
import pytest

from marketplace.models import GpuModel, NodeState, Verdict
from provisioning.models import VerificationRun
from provisioning.selectors import fleet_reference
from provisioning.verification.profiles import fleet_figures
from provisioning.verification.tolerances import TOLERANCES
from tests.factories import UserFactory, make_node

pytestmark = pytest.mark.django_db


def a10():
    return GpuModel.objects.get(slug="a10")


def fleet_node(bf16: float, verdict=Verdict.VERIFIED, state=NodeState.ACTIVE, slug="a10", device="cuda",
               provider=None):
    node = make_node(provider or UserFactory(), gpu_model=slug, gpu_count=1, state=state, verdict=verdict)
    VerificationRun.objects.create(node=node, verdict=verdict,
                                   figures={"device": device, "median": {"bf16_tflops": bf16, "fp32_tflops": 24.0}})
    return node


def test_no_reference_below_the_settings_number_of_nodes(settings):
    settings.FLEET_REFERENCE_MIN_NODES = 5
    for value in (100.0, 101.0, 99.0, 100.5):
        fleet_node(value)
    assert fleet_reference(a10().pk) is None
    fleet_node(98.0)
    ref = fleet_reference(a10().pk)
    assert ref is not None and ref.nodes == 5
    assert ref.median == {"bf16_tflops": 100.0, "fp32_tflops": 24.0}
    settings.FLEET_REFERENCE_MIN_NODES = 6
    assert fleet_reference(a10().pk) is None


def test_only_each_live_nodes_latest_verified_cuda_run_counts(settings):
    settings.FLEET_REFERENCE_MIN_NODES = 3
    counted = [fleet_node(100.0), fleet_node(102.0), fleet_node(98.0)]
    fleet_node(10.0, verdict=Verdict.DEGRADED)  # degraded: perhaps for being below this very reference
    fleet_node(10.0, verdict=Verdict.REJECTED, state=NodeState.REJECTED)  # rejected: not the model
    fleet_node(10.0, state=NodeState.RETIRED)  # gone
    fleet_node(10.0, device="cpu")  # measured on the host CPU (tests)
    fleet_node(10.0, slug="l4")  # another model
    newer_rejected = fleet_node(100.0)
    VerificationRun.objects.create(node=newer_rejected, verdict=Verdict.REJECTED, figures={})  # its latest
    remeasured = counted[0]
    VerificationRun.objects.create(node=remeasured, verdict=Verdict.VERIFIED,
                                   figures={"device": "cuda", "median": {"bf16_tflops": 104.0}})
    ref = fleet_reference(a10().pk)
    assert ref is not None and ref.nodes == 3 and ref.median["bf16_tflops"] == 102.0  # 104, 102, 98
    assert fleet_reference(a10().pk, exclude_node_id=remeasured.pk) is None  # the node judged is not its own fleet


def test_a_seeded_fleet_of_honest_a10s_puts_the_impostor_under_its_floor(settings):
    """The reference built from the seeded runs: the impostor profile's figures fall under it, an honest A10's do
    not (test_benchmark_verification.py verifies the impostor through a sim node over SSH against such a fleet)."""
    settings.FLEET_REFERENCE_MIN_NODES = 5
    for figures in fleet_figures("a10-x2", 6):
        node = make_node(UserFactory(), gpu_model="a10", gpu_count=2, state=NodeState.ACTIVE,
                         verdict=Verdict.VERIFIED)
        VerificationRun.objects.create(node=node, verdict=Verdict.VERIFIED, figures=figures)
    ref = fleet_reference(a10().pk)
    assert ref is not None and ref.nodes == 6
    assert set(ref.median) == set(TOLERANCES["fleet_max_gap"])
    honest, = fleet_figures("a10-x2", 1)
    impostor, = fleet_figures("slow-card-posing-as-a10-x2", 1)
    assert all(g["bf16_tflops"] >= ref.floor("bf16_tflops") for g in honest["gpus"])
    assert all(g["bf16_tflops"] < ref.floor("bf16_tflops") for g in impostor["gpus"])


def test_nodes_degraded_below_the_fleet_do_not_drag_its_median_down(settings):
    """Impostors degraded for sitting below the fleet (below_fleet_median) are listable: counted, once they were
    as many as the honest nodes the median was theirs and the next impostor was not below it (found by review)."""
    settings.FLEET_REFERENCE_MIN_NODES = 5
    for value in (100.0, 101.0, 99.0, 100.5, 98.5):
        fleet_node(value)
    for value in (85.0, 85.5, 84.5, 86.0, 85.2, 84.8):
        fleet_node(value, verdict=Verdict.DEGRADED)
    ref = fleet_reference(a10().pk)
    assert ref.median["bf16_tflops"] == 100.0 and ref.floor("bf16_tflops") > 86.0


def test_each_provider_counts_once_and_never_in_its_own_nodes_reference(settings):
    """Six nodes of one provider against five others' honest nodes: counted per node, that provider's figures were
    the median, and its next impostor passed (found by review). Each provider is the median of its nodes now, and
    the node judged is compared with other providers only."""
    settings.FLEET_REFERENCE_MIN_NODES = 5
    for value in (100.0, 101.0, 99.0, 100.5, 98.5):
        fleet_node(value)
    cartel = UserFactory()
    for value in (85.0, 85.5, 84.5, 86.0, 85.2, 84.8):
        fleet_node(value, provider=cartel)
    ref = fleet_reference(a10().pk)
    assert (ref.nodes, ref.providers) == (11, 6)
    assert ref.median["bf16_tflops"] == 99.5 and ref.floor("bf16_tflops") > 86.0  # 98.5 .. 101 and 85.1
    mine = fleet_reference(a10().pk, exclude_provider_id=cartel.pk)
    assert (mine.nodes, mine.providers, mine.median["bf16_tflops"]) == (5, 5, 100.0)


def test_no_reference_from_fewer_providers_than_the_setting(settings):
    settings.FLEET_REFERENCE_MIN_NODES, settings.FLEET_REFERENCE_MIN_PROVIDERS = 5, 3
    one, two = UserFactory(), UserFactory()
    for provider in (one, one, one, two, two):
        fleet_node(100.0, provider=provider)
    assert fleet_reference(a10().pk) is None
    fleet_node(100.0)
    assert fleet_reference(a10().pk).providers == 3
    assert fleet_reference(a10().pk, exclude_provider_id=two.pk) is None


def test_a_figure_too_few_nodes_or_providers_measured_is_left_out_of_the_reference(settings):
    """The minimums hold per figure: platform_bf16_tflops is in no run from before it was kept, so the first node
    re-verified since would have been that figure's whole fleet (one node, MAD 0: a floor 10 % under it for every
    honest node; found by review)."""
    settings.FLEET_REFERENCE_MIN_NODES, settings.FLEET_REFERENCE_MIN_PROVIDERS = 5, 3
    for value in (100.0, 101.0, 99.0, 100.5, 98.5):
        fleet_node(value)
    first = make_node(UserFactory(), gpu_model="a10", gpu_count=1, state=NodeState.ACTIVE, verdict=Verdict.VERIFIED)
    VerificationRun.objects.create(node=first, verdict=Verdict.VERIFIED, figures={
        "device": "cuda", "median": {"bf16_tflops": 100.0, "fp32_tflops": 24.0, "platform_bf16_tflops": 140.0}})
    ref = fleet_reference(a10().pk)
    assert ref.providers == 6 and set(ref.median) == {"bf16_tflops", "fp32_tflops"}
    assert ref.floor("platform_bf16_tflops") is None
