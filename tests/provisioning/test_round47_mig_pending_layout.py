"""A MIG layout declared for a card renters hold waits for them (review r47, finding 1): the check does not judge
that card against it, cuts no renter's price and does not reject the node. Before, the card still had the layout
its renters use, the check rejected the node as a mismatch, and its renters were cut to $0/h (a 3g slice from
$0.25/h, a whole GPU from $1.50/h). A free card with the wrong layout is rejected as before."""
from decimal import Decimal

import pytest

from marketplace.models import GpuModel, Image, Instance, Node
from marketplace.services import instances as instance_svc
from marketplace.services.nodes import node_update
from provisioning.models import NodeEvent, VerificationRun
from provisioning.verification.mig import judge_mig, pending_layout
from provisioning.verification.model import DeclaredModel
from provisioning.verification.policy import judge
from tests.factories import UserFactory
from tests.marketplace.renting_helpers import ed25519_key
from tests.provisioning.test_benchmark_verification import register, simbase, simnode, verify

__all__ = ["simbase", "simnode"]

MIG_PROFILE = "a100-80gb-sxm-x2-mig"  # GPU 0 split 3g.40gb, 2g.20gb, 1g.10gb, 1g.10gb on the server; GPU 1 whole
OLD_SPLIT = ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
ALL_PRICES = {"3g.40gb": Decimal("0.25"), "2g.20gb": Decimal("0.25"), "1g.10gb": Decimal("0.25"),
              "7g.80gb": Decimal("1.00")}


def _rent(node, num_gpus=1, **kw):
    inst, _ = instance_svc.instance_create(renter=UserFactory(), node_id=node.pk, num_gpus=num_gpus,
                                           image=Image.objects.filter(active=True).first(),
                                           ssh_public_keys=[ed25519_key()], **kw)
    instance_svc.instance_mark_provisioning(instance_id=inst.pk)
    return instance_svc.instance_mark_running(instance_id=inst.pk, ssh_host="127.0.0.1", ssh_port=40001,
                                              ssh_user="root")


def _price(inst) -> int:
    return Instance.objects.get(pk=inst.pk).price_per_hour_micros


def _cut_events(node) -> list[str]:
    return list(NodeEvent.objects.filter(node=node, kind="renters_price_cut").values_list("message", flat=True))


@pytest.mark.slow
def test_declaring_the_next_split_of_a_card_with_a_rented_slice_cuts_no_one(db, simnode, simbase, settings):
    settings.BILLING_REQUIRE_FUNDS = False
    node = register(simnode, simbase, MIG_PROFILE)
    node, _ = verify(node)
    assert node.verdict == "verified"
    sliced = _rent(node, 1, mig_profile="3g.40gb")  # a slice of GPU 0, $0.25/h
    whole = _rent(node, 1)  # GPU 1 whole, $1.50/h
    before = (_price(sliced), _price(whole))
    assert before == (250_000, 1_500_000)
    # The provider will re-split GPU 0's free part (2g + 1g + 1g -> a second 3g) and declares it first.
    node_update(node=Node.objects.get(pk=node.pk), mig_layout=[{"gpu": 0, "profiles": ["3g.40gb", "3g.40gb"]}],
                mig_prices={"3g.40gb": Decimal("0.25")})
    node, job = verify(node)  # "Verify now" / the periodic re-check, before the card is re-split
    assert (_price(sliced), _price(whole)) == before, _cut_events(node)
    assert node.verdict == "verified", node.last_error
    run = VerificationRun.objects.filter(node=node).latest("pk")
    assert not [f for f in run.findings if f["code"].startswith("mig_")], run.findings
    assert run.figures["mig_pending"] == [0]
    # Said to the provider: the API's last_error, the node's events and the check's steps.
    assert "pending for GPU 0 (3g.40gb, 3g.40gb)" in node.last_error
    assert NodeEvent.objects.filter(node=node, kind="mig_layout_pending").exists()
    assert any("pending" in line["message"] for line in job.log)
    # The old free slices (2g, 1g, 1g) are not in the declaration: not offered; the renter keeps theirs.
    free = set(node.mig_slices.filter(status="free").values_list("profile", flat=True))
    assert free == set()
    assert node.mig_slices.filter(status="rented", profile="3g.40gb").count() == 1


@pytest.mark.slow
def test_declaring_a_rented_whole_card_split_cuts_no_one(db, simnode, simbase, settings):
    settings.BILLING_REQUIRE_FUNDS = False
    node = register(simnode, simbase, MIG_PROFILE)
    node, _ = verify(node)
    sliced = _rent(node, 1, mig_profile="3g.40gb")
    whole = _rent(node, 1)  # GPU 1 whole, $1.50/h
    before = (_price(sliced), _price(whole))
    # The provider means to split GPU 1 too once its renter leaves, and declares it now.
    node_update(node=Node.objects.get(pk=node.pk),
                mig_layout=[{"gpu": 0, "profiles": OLD_SPLIT}, {"gpu": 1, "profiles": ["7g.80gb"]}],
                mig_prices=ALL_PRICES)
    node, _ = verify(node)
    assert (_price(sliced), _price(whole)) == before, _cut_events(node)
    assert node.verdict == "verified", node.last_error
    assert node.listed
    run = VerificationRun.objects.filter(node=node).latest("pk")
    assert run.figures["mig_pending"] == [1]
    assert "pending for GPU 1 (7g.80gb)" in node.last_error
    # GPU 0's free slices were measured and stay on offer; GPU 1 stays its renter's.
    assert set(node.mig_slices.filter(status="free").values_list("profile", flat=True)) == {"2g.20gb", "1g.10gb"}
    assert node.gpus.get(index=1).status == "rented"


@pytest.mark.slow
def test_a_free_card_with_the_wrong_layout_is_still_rejected(db, simnode, simbase, settings):
    settings.BILLING_REQUIRE_FUNDS = False
    node = register(simnode, simbase, MIG_PROFILE)
    node, _ = verify(node)
    sliced = _rent(node, 1, mig_profile="3g.40gb")  # GPU 1 stays free, whole, MIG off
    node_update(node=Node.objects.get(pk=node.pk),
                mig_layout=[{"gpu": 0, "profiles": OLD_SPLIT}, {"gpu": 1, "profiles": ["7g.80gb"]}],
                mig_prices=ALL_PRICES)
    node, _ = verify(node)
    assert node.verdict == "rejected"
    run = VerificationRun.objects.filter(node=node).latest("pk")
    assert {(f["code"], f["gpu_index"]) for f in run.findings if f["severity"] == "reject"} == {
        ("mig_not_configured", 1)}
    assert "mig_pending" not in run.figures
    assert _price(sliced) == 250_000  # the rejection is about GPU 1, which no renter holds


# --------------------------------------------------------------------------- the rule itself, without a node

def _a100() -> DeclaredModel:
    return DeclaredModel.from_gpu_model(GpuModel.objects.get(slug="a100-80gb-sxm"))


def _inventory(mode0="Enabled", mode1="Disabled", devices=OLD_SPLIT):
    gpus = [{"index": 0, "uuid": "GPU-0", "mig_mode": mode0, "name": "NVIDIA A100-SXM4-80GB",
             "memory_total_mib": 81920},
            {"index": 1, "uuid": "GPU-1", "mig_mode": mode1, "name": "NVIDIA A100-SXM4-80GB",
             "memory_total_mib": 81920}]
    mig = [{"gpu": 0, "device": n, "profile": p, "uuid": f"MIG-{n}"} for n, p in enumerate(devices)]
    return gpus, mig


def test_pending_only_while_every_rented_slice_is_still_on_the_card():
    gpus, mig = _inventory()
    layout = {0: ["3g.40gb", "3g.40gb"]}
    assert pending_layout(layout, gpus, mig, {0: frozenset({"MIG-0"})}) == [0]
    # The renter's slice is gone from the card: it is judged, as any other.
    assert pending_layout(layout, gpus, mig, {0: frozenset({"MIG-9"})}) == []
    # Nobody holds it: judged.
    assert pending_layout(layout, gpus, mig, {}) == []
    # Configured as declared: judged (its free slices measured), nothing pending.
    assert pending_layout({0: OLD_SPLIT}, gpus, mig, {0: frozenset({"MIG-0"})}) == []
    # Held whole, declared split, MIG off: pending; held whole and not declared split: judged as now.
    assert pending_layout({1: ["7g.80gb"]}, gpus, mig, {1: frozenset()}) == [1]
    assert pending_layout({}, gpus, mig, {1: frozenset()}) == []


@pytest.mark.django_db
def test_a_card_declared_whole_again_keeps_mig_mode_while_its_slices_are_rented():
    declared = _a100()
    gpus, mig = _inventory()
    inventory = {"gpus": gpus, "mig": mig}
    # The provider took GPU 0 out of the layout; its 3g slice is rented: MIG mode stays on until its renter leaves.
    held = judge_mig(declared, {}, inventory, None, ["MIG-0"], held={0: frozenset({"MIG-0"})})
    result = judge(declared, 2, gpus, None, mig=held)
    assert not [f for f in result.findings if f.code.startswith("mig_")], result.findings
    # Nobody on it: MIG mode on an undeclared card is rejected, as before.
    free = judge_mig(declared, {}, inventory, None)
    result = judge(declared, 2, gpus, None, mig=free)
    assert ("mig_enabled", 0) in {(f.code, f.gpu_index) for f in result.findings}
