"""An offer id names a listing at a price (review r52): `vastai create instance ASK` booked at whatever the node
asked at that moment, so a renter who searched at $0.80/h was booked at $40/h after the provider re-listed higher,
with a plain success. A raise of the GPU or disk price now makes new ids (compat.vast.offers: the price generation);
an id from before it is a 409 that books nothing, and a cut or an unchanged price still books with the old id."""
import pytest

from marketplace.models import Instance, InstanceStatus, InterruptionCause
from marketplace.services.instances.interruptions import instance_interrupt
from tests.billing.helpers import balance, fund
from tests.compat.test_api import V0, _create, msg, search
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import add_key, book, run


@pytest.fixture
def market(db):
    """test_api's market: an RTX A6000 node of 3 GPUs at $0.80 per GPU-hour (disk $0.10 per GB-month), an A100
    node of 2 at $2."""
    provider = UserFactory()
    a6000 = make_listed_node(provider, gpu_model="rtx-a6000", gpu_count=3, price="0.800000", country="SE",
                             score=1.2, reliability=0.97)
    a100 = make_listed_node(provider, gpu_model="a100-80gb-sxm", gpu_count=2, price="2.000000", score=3.0)
    return provider, a6000, a100


def _relist(client_for, provider, node, **prices):
    r = client_for(provider).put(f"{V0}/machines/create_asks/", {"machine": node.pk, **prices}, format="json")
    assert r.status_code == 200, r.content


def _offers(client, **query):
    return {o["id"]: o for o in search(client, **query).json()["offers"]}


@pytest.fixture
def renter(api):
    add_key(api.user)
    fund(api.user, "500.00")
    return api


def test_a_raise_between_search_and_create_is_a_409_that_books_nothing(renter, client_for, market):
    provider, a6000, _ = market
    ask = a6000.pk * 100 + 1
    assert _offers(renter)[ask]["dph_total"] == pytest.approx(0.8)
    before = balance(renter.user)
    _relist(client_for, provider, a6000, price_gpu=40)  # the provider re-lists at 50x after the renter's search
    r = _create(renter, ask)
    assert r.status_code == 409, r.content
    new_ask = (10**10 + a6000.pk) * 100 + 1
    assert r.json()["error"] == "price_changed"
    assert msg(r) == (f"Offer {ask}'s price has risen since your search: its 1 GPU now cost $40.00/hour, disk $0.10 "
                      "per GB-month (it was $0.80/hour, disk $0.10 per GB-month, when you searched). Nothing was "
                      f"booked. Search again (`vastai search offers`): at the new price it is offer {new_ask}.")
    assert not Instance.objects.filter(renter=renter.user).exists()
    assert balance(renter.user) == before
    # A search now shows the new ids at the new price, and one of them books at it.
    offers = _offers(renter, machine_id={"eq": a6000.pk})
    assert sorted(offers) == [new_ask, new_ask + 1, new_ask + 2]
    assert offers[new_ask]["dph_total"] == pytest.approx(40.0)
    r = _create(renter, new_ask)
    assert r.status_code == 200, r.content
    assert Instance.objects.get(pk=r.json()["new_contract"]).price_per_hour_micros == 40_000_000


def test_a_raise_of_the_disk_price_alone_makes_new_ids_too(renter, client_for, market):
    """A stopped instance's disk is billed at the price booked (storage_cost): its raise is a raise."""
    provider, a6000, _ = market
    ask = a6000.pk * 100 + 2
    _relist(client_for, provider, a6000, price_gpu=0.8, price_disk=5)
    r = _create(renter, ask)
    assert r.status_code == 409 and "disk $5.00 per GB-month (it was $1.60/hour, disk $0.10" in msg(r), r.content
    assert not Instance.objects.filter(renter=renter.user).exists()
    assert (10**10 + a6000.pk) * 100 + 2 in _offers(renter)


def test_an_id_from_before_two_raises_is_refused_and_says_so(renter, client_for, market):
    provider, a6000, _ = market
    _relist(client_for, provider, a6000, price_gpu=1)
    _relist(client_for, provider, a6000, price_gpu=0.5)  # a cut: no new ids
    _relist(client_for, provider, a6000, price_gpu=0.9)
    r = _create(renter, a6000.pk * 100 + 1)
    assert r.status_code == 409 and "(it was $0.50/hour, disk $0.10 per GB-month, before the last of the 2 raises " \
        f"since your search). Nothing was booked. Search again (`vastai search offers`): at the new price it is " \
        f"offer {(2 * 10**10 + a6000.pk) * 100 + 1}." in msg(r), r.content
    # An id of the generation before the last one: refused as well, though the price is below its search's now.
    assert _create(renter, (10**10 + a6000.pk) * 100 + 1).status_code == 409
    assert not Instance.objects.filter(renter=renter.user).exists()


def test_a_cut_keeps_the_id_and_books_at_the_lower_price(renter, client_for, market):
    provider, a6000, _ = market
    ask = a6000.pk * 100 + 2
    _relist(client_for, provider, a6000, price_gpu=0.5, price_disk=0.05)
    assert _offers(renter)[ask]["dph_total"] == pytest.approx(1.0)
    r = _create(renter, ask)
    assert r.status_code == 200, r.content
    instance = Instance.objects.get(pk=r.json()["new_contract"])
    assert (instance.price_per_hour_micros, instance.disk_price_per_gb_month_micros) == (1_000_000, 50_000)


def test_an_unchanged_price_books_with_the_old_id(renter, client_for, market):
    provider, a6000, _ = market
    ask = a6000.pk * 100 + 1
    _relist(client_for, provider, a6000, price_gpu=0.8, price_disk=0.1)  # the same prices, listed again
    assert ask in _offers(renter)
    r = _create(renter, ask)
    assert r.status_code == 200, r.content
    assert Instance.objects.get(pk=r.json()["new_contract"]).price_per_hour_micros == 800_000


def test_an_id_of_a_generation_not_reached_is_a_404(renter, market):
    _, a6000, _ = market
    r = _create(renter, (3 * 10**10 + a6000.pk) * 100 + 1)
    assert r.status_code == 404 and "There is no offer" in msg(r), r.content


def test_offers_ordered_by_id_follow_the_new_ids(renter, client_for, market):
    """The scan by id reads the nodes in the ids' order (generation, then node), not the node ids'."""
    provider, a6000, a100 = market
    _relist(client_for, provider, a6000, price_gpu=1)
    for order, expected in (("asc", [a100.pk * 100 + 1, a100.pk * 100 + 2]),
                            ("desc", [(10**10 + a6000.pk) * 100 + n for n in (3, 2)])):
        found = search(renter, order=[["id", order]], limit=2).json()["offers"]
        assert [o["id"] for o in found] == expected, order


def test_an_interrupted_instance_is_vasts_unknown_not_loading(renter, market):
    """Review r52, suspicion 1: a script waiting for "running" took an instance whose node stopped answering for
    one booting. Vast's `unknown` is "no recent heartbeat from the host"."""
    _, a6000, _ = market
    instance = run(book(renter.user, a6000))
    assert instance_interrupt(instance_id=instance.pk, since=None, cause=InterruptionCause.NODE_LOST, detail="x")
    assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.INTERRUPTED
    shown = renter.get(f"{V0}/instances/{instance.pk}/").json()["instances"]
    assert (shown["actual_status"], shown["intended_status"]) == ("unknown", "running")
