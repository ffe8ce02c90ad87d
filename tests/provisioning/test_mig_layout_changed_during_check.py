"""A provider who declares another MIG layout while a check runs (node_update mid-check): the check judged the
layout it read when it began, so its conclusion applies its slices only to the cards whose layout did not change;
the changed cards keep their status and their slices leave the offers, and a new check judges the layout declared
now (found by review: a card taken out of the layout was listed whole while still in MIG mode on the server)."""
from decimal import Decimal

import pytest
from django.utils import timezone

from marketplace.models import Gpu, GpuStatus, MigSlice, Node, NodeState, SliceStatus
from marketplace.models.nodes import OFFERABLE
from marketplace.selectors import free_slices_by_node
from marketplace.services.nodes import node_update
from provisioning.models import Job, JobKind, JobStatus, NodeEvent
from provisioning.services import verification
from provisioning.services.maintenance import nodes_reverify_due
from provisioning.services.mig import layout_changed_gpus
from provisioning.services.runner import job_begin
from tests.provisioning.test_benchmark_verification import register, simbase, simnode, verify

__all__ = ["simbase", "simnode"]

MIG_PROFILE = "a100-80gb-sxm-x2-mig"  # GPU 0 split 3g.40gb, 2g.20gb, 1g.10gb, 1g.10gb on the server


def test_layout_changed_gpus_names_the_cards_whose_profiles_differ():
    old = [{"gpu": 0, "profiles": ["3g.40gb", "1g.10gb"]}, {"gpu": 1, "profiles": ["7g.80gb"]}]
    assert layout_changed_gpus(old, old) == []
    assert layout_changed_gpus([{"gpu": 0, "profiles": ["1g.10gb", "3g.40gb"]}, old[1]], old) == []  # order
    assert layout_changed_gpus([], old) == [0, 1]
    assert layout_changed_gpus([old[0], {"gpu": 1, "profiles": ["3g.40gb", "3g.40gb"]}], old) == [1]
    assert layout_changed_gpus(old, None) == [0, 1]


def _provider_saves_during_the_check(monkeypatch, node: Node, **changes) -> None:
    real = verification.node_verify_conclude

    def provider_saves_meanwhile(**kw):
        node_update(node=Node.objects.get(pk=node.pk), **changes)
        return real(**kw)

    monkeypatch.setattr(verification, "node_verify_conclude", provider_saves_meanwhile)


def _queued_recheck(node: Node) -> Job:
    return Job.objects.get(node=node, kind=JobKind.NODE_VERIFY, status=JobStatus.QUEUED)


def _queued_at_the_cooldowns_end(node: Node) -> Job:
    """The check that ended started its provider's verify cooldown (its verdict): the new check is not queued at
    once (a layout changed during each check was a fresh verdict each time) but due at the cooldown's end, and the
    re-verification beat queues it then (tests/provisioning/test_verify_cooldown.py)."""
    assert not Job.objects.filter(node=node, kind=JobKind.NODE_VERIFY, status=JobStatus.QUEUED).exists()
    due = Node.objects.get(pk=node.pk).next_check_at
    assert due > timezone.now()
    nodes_reverify_due(now=due)
    return _queued_recheck(node)


@pytest.mark.slow
def test_a_card_taken_out_of_the_layout_during_the_check_is_not_listed_whole(db, simnode, simbase, monkeypatch):
    node = register(simnode, simbase, MIG_PROFILE)
    node, _ = verify(node)
    assert node.verdict == "verified" and Gpu.objects.get(node=node, index=0).status == GpuStatus.MIG
    _provider_saves_during_the_check(monkeypatch, node, mig_layout=[], mig_prices={})
    node, job = verify(node)
    assert job.status == JobStatus.SUCCEEDED and node.verdict == "verified"
    # Still in MIG mode on the server: not rentable whole, and its slices (of a layout no longer declared) are off.
    assert Gpu.objects.get(node=node, index=0).status == GpuStatus.MIG
    assert not MigSlice.objects.filter(node=node).exclude(status=SliceStatus.UNAVAILABLE).exists()
    assert Node.objects.filter(OFFERABLE, pk=node.pk).exists()  # GPU 1, whole as judged, stays on the offers
    assert NodeEvent.objects.filter(node=node, kind="mig_layout_changed_during_check").exists()
    # The check it queued judges the layout declared now: a card in MIG mode declared whole is not listed.
    monkeypatch.undo()
    verification.node_verify_run(job=job_begin(job_id=_queued_at_the_cooldowns_end(node).pk))
    node.refresh_from_db()
    assert node.verdict == "rejected" and not Node.objects.filter(OFFERABLE, pk=node.pk).exists()


@pytest.mark.slow
def test_a_layout_changed_with_the_maintenance_begun_during_the_check_waits_for_its_end(db, simnode, simbase,
                                                                                          monkeypatch):
    """The provider saves the new layout and goes into maintenance to re-split the cards: the check is not queued
    (a verification request would take the node out of the provider's maintenance and judge the old split: the
    first fix did, and rejected the node, found by the second review round); it is due (at the end of the provider's
    verify cooldown, which this check's verdict started), and the beat queues it when the maintenance ends."""
    node = register(simnode, simbase, MIG_PROFILE)
    node, _ = verify(node)
    _provider_saves_during_the_check(monkeypatch, node, mig_layout=[], mig_prices={}, maintenance=True)
    node, job = verify(node)
    monkeypatch.undo()
    assert (node.state, node.verdict) == (NodeState.MAINTENANCE, "verified")
    assert not Job.objects.filter(node=node, kind=JobKind.NODE_VERIFY, status=JobStatus.QUEUED).exists()
    node_update(node=Node.objects.get(pk=node.pk), maintenance=False)
    assert _queued_at_the_cooldowns_end(node)


@pytest.mark.slow
def test_slices_of_the_old_layout_are_not_listed_under_a_new_one(db, simnode, simbase, monkeypatch):
    """The variant: a new layout of other profiles, one of which the old layout had too (priced at once): the old
    layout's proven 3g.40gb slice is not listed as one of the new layout's."""
    node = register(simnode, simbase, MIG_PROFILE)
    node, _ = verify(node)
    assert free_slices_by_node([node.pk])[node.pk]["3g.40gb"] == 1
    _provider_saves_during_the_check(monkeypatch, node, mig_layout=[{"gpu": 0, "profiles": ["3g.40gb", "3g.40gb"]}],
                                     mig_prices={"3g.40gb": Decimal("1.10")})
    node, _ = verify(node)
    assert node.verdict == "verified"
    assert free_slices_by_node([node.pk]) == {}
    assert Gpu.objects.get(node=node, index=0).status == GpuStatus.MIG
    _queued_at_the_cooldowns_end(node)


@pytest.mark.slow
def test_prices_saved_during_the_check_change_nothing_of_it(db, simnode, simbase, monkeypatch):
    node = register(simnode, simbase, MIG_PROFILE)
    node, _ = verify(node)
    _provider_saves_during_the_check(monkeypatch, node, mig_prices={p: Decimal("0.30") for p in
                                                                    ("3g.40gb", "2g.20gb", "1g.10gb")})
    node, _ = verify(node)
    assert free_slices_by_node([node.pk])[node.pk] == {"3g.40gb": 1, "2g.20gb": 1, "1g.10gb": 2}
    assert not Job.objects.filter(node=node, kind=JobKind.NODE_VERIFY, status=JobStatus.QUEUED).exists()
    assert not NodeEvent.objects.filter(node=node, kind="mig_layout_changed_during_check").exists()
