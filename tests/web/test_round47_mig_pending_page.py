"""The provider's server page says which card's declared MIG layout waits for its renters, the layout declared,
what the card has now, and how many instances it waits for. Before, only the check's steps (gone once the job
ended), a mig_layout_pending event and the API's last_error said it (an active node's page shows no last_error):
a provider who declared a layout for a rented card saw "MIG layout saved" and then nothing of why it was not
applied."""
import re
from decimal import Decimal

import pytest
from django.test import Client

from marketplace.models import Instance, Node
from marketplace.services import instances as svc
from marketplace.services.nodes import node_update
from tests.billing.helpers import fund
from tests.factories import UserFactory
from tests.marketplace.mig_helpers import make_mig_node
from tests.marketplace.renting_helpers import book, run

pytestmark = pytest.mark.django_db

PRICES = {"7g.80gb": Decimal("1.00")}


def _page(node) -> str:
    web = Client()
    web.force_login(node.provider)
    page = web.get(f"/nodes/{node.pk}/")
    assert page.status_code == 200
    return page.content.decode()


def _pending(page: str) -> str:
    found = re.search(r'<div id="mig-pending".*?</div>', page, re.S)
    assert found, "the page says the declared layout is pending"
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", found.group(0)))


def _renter():
    user = UserFactory()
    fund(user, "50")
    return user


def test_the_node_page_says_which_cards_layout_waits_for_how_many_renters():
    # GPU 0 split in two 3g.40gb slices, both rented; GPU 1 rented whole.
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, gpu_count=2, prices={"3g.40gb": "0.25"})
    slices = [run(book(_renter(), node, mig_profile="3g.40gb")) for _ in range(2)]
    whole = run(book(_renter(), node))
    assert 'id="mig-pending"' not in _page(node)  # nothing declared anew: nothing pending
    # Declared: GPU 0 one 7g.80gb slice, GPU 1 split too.
    node_update(node=Node.objects.get(pk=node.pk), mig_layout=[{"gpu": 0, "profiles": ["7g.80gb"]},
                                                               {"gpu": 1, "profiles": ["7g.80gb"]}],
                mig_prices=PRICES)
    said = _pending(_page(node))
    assert "GPU 0: declared 7g.80gb, now 3g.40gb, 3g.40gb · waits for 2 instances" in said, said
    assert "GPU 1: declared 7g.80gb, now whole · waits for 1 instance" in said, said
    # One slice renter leaves: GPU 0 waits for the other; the whole card's renter leaves: GPU 1 is no longer held.
    svc.instance_destroy(instance=Instance.objects.get(pk=slices[0].pk))
    svc.instance_mark_destroyed(instance_id=slices[0].pk)
    svc.instance_destroy(instance=Instance.objects.get(pk=whole.pk))
    svc.instance_mark_destroyed(instance_id=whole.pk)
    said = _pending(_page(node))
    assert "GPU 0: declared 7g.80gb, now 3g.40gb · waits for 1 instance" in said, said
    # GPU 1 is no longer held: free now, withheld until re-split (round 52: said so, not left off the list).
    assert "GPU 1: declared 7g.80gb · free now" in said and "GPU 1: declared 7g.80gb, now" not in said, said


def test_a_card_declared_whole_again_under_its_slice_renter_is_said_pending():
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, gpu_count=1, prices={"3g.40gb": "0.25"})
    run(book(_renter(), node, mig_profile="3g.40gb"))
    node_update(node=Node.objects.get(pk=node.pk), mig_layout=[], mig_prices={})
    said = _pending(_page(node))
    assert "GPU 0: declared whole, now 3g.40gb, 3g.40gb · waits for 1 instance" in said, said
