"""The provider's server page also lists a card freed for a layout declared while it was rented (ee23e2e: withheld
and pending until the provider re-splits it and presses Verify now), saying what to do. Before, the page listed only
cards renters hold: such a card, out of the offers, showed nowhere on the page."""
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from marketplace.models import Instance, Node
from marketplace.services import instances as svc
from marketplace.services.instances.mig import node_cards_pending_layout
from marketplace.services.nodes import node_update
from tests.factories import make_listed_node
from tests.marketplace.mig_helpers import make_mig_node
from tests.marketplace.renting_helpers import book, run
from tests.web.test_round47_mig_pending_page import _page, _pending, _renter

pytestmark = pytest.mark.django_db

PRICES = {"7g.80gb": Decimal("1.00")}


def _leave(inst: Instance) -> None:
    svc.instance_destroy(instance=Instance.objects.get(pk=inst.pk))
    svc.instance_mark_destroyed(instance_id=inst.pk)


def test_a_sliced_card_freed_for_its_new_layout_is_listed_free_now_beside_a_held_one():
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"], 1: ["3g.40gb", "3g.40gb"]}, gpu_count=2,
                         prices={"3g.40gb": "0.25"})
    first = [run(book(_renter(), node, mig_profile="3g.40gb")) for _ in range(4)]
    node_update(node=Node.objects.get(pk=node.pk), mig_layout=[{"gpu": 0, "profiles": ["7g.80gb"]},
                                                               {"gpu": 1, "profiles": ["7g.80gb"]}],
                mig_prices=PRICES)
    on_0 = [i for i in first if i.slice_allocations.get().mig_slice.gpu.index == 0]
    for inst in on_0:
        _leave(inst)
    said = _pending(_page(node))
    assert ("GPU 0: declared 7g.80gb · free now: configure it as declared (7g.80gb), then Verify now"
            in said), said
    assert "GPU 1: declared 7g.80gb, now 3g.40gb, 3g.40gb · waits for 2 instances" in said, said
    assert "GPU 0: declared 7g.80gb, now" not in said, said


def test_a_whole_card_declared_split_and_freed_is_listed_free_now():
    node = make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=2, runtime="docker")
    inst = run(book(_renter(), node))
    node_update(node=Node.objects.get(pk=node.pk), mig_layout=[{"gpu": 0, "profiles": ["7g.80gb"]}],
                mig_prices=PRICES)
    _leave(inst)
    said = _pending(_page(node))
    assert "GPU 0: declared 7g.80gb · free now: configure it as declared (7g.80gb), then Verify now" in said, said


def test_a_card_declared_whole_again_and_freed_is_listed_free_now():
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, gpu_count=1, prices={"3g.40gb": "0.25"})
    inst = run(book(_renter(), node, mig_profile="3g.40gb"))
    node_update(node=Node.objects.get(pk=node.pk), mig_layout=[], mig_prices={})
    _leave(inst)
    said = _pending(_page(node))
    assert "GPU 0: declared whole · free now: configure it as declared (whole: MIG mode off), then Verify now" in said


def test_a_card_never_rented_is_not_listed_and_the_queries_do_not_grow_with_the_cards():
    idle = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, gpu_count=1, prices={"3g.40gb": "0.25"})
    node_update(node=Node.objects.get(pk=idle.pk), mig_layout=[{"gpu": 0, "profiles": ["7g.80gb"]}],
                mig_prices=PRICES)
    assert node_cards_pending_layout(idle.pk) == []  # free, nobody rented it: the check judges it as before
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"], 1: ["3g.40gb", "3g.40gb"]}, gpu_count=2,
                         prices={"3g.40gb": "0.25"})
    insts = [run(book(_renter(), node, mig_profile="3g.40gb")) for _ in range(4)]
    node_update(node=Node.objects.get(pk=node.pk), mig_layout=[{"gpu": 0, "profiles": ["7g.80gb"]},
                                                               {"gpu": 1, "profiles": ["7g.80gb"]}],
                mig_prices=PRICES)
    on = {g: [i for i in insts if i.slice_allocations.get().mig_slice.gpu.index == g] for g in (0, 1)}
    for inst in on[0]:
        _leave(inst)
    with CaptureQueriesContext(connection) as one:
        assert [c["gpu"] for c in node_cards_pending_layout(node.pk) if c["free"]] == [0]
    for inst in on[1]:
        _leave(inst)
    with CaptureQueriesContext(connection) as two:
        assert [c["gpu"] for c in node_cards_pending_layout(node.pk) if c["free"]] == [0, 1]
    assert len(two) == len(one)
