"""Every renter-facing reader of what storage cost agrees with the ledger once an operator reversed a storage charge.

A stopped instance's disk and a volume are billed by storage charges (billing.services.storage), which add to the
row's own total (Instance.disk_cost_micros, Volume.cost_micros: what was charged, read by the meter's cumulative
arithmetic). An operator's reversal of one (ledger_reverse, what the admin's "Reverse" action calls) gives it back
to the renter's wallet. Before, the instances API's `disk_cost_so_far` (list, detail, a verb's answer), the instance
page's disk line, the volumes API's `cost_so_far` and the volumes page read the row's total: they said the renter
paid what the ledger says was given back. Now they read the ledger's net, carried in each list's own query. The
provider's earnings (API, page, per server) were already read from the ledger net of reversals and are checked
alongside. The Vast-compatible API's `storage_cost` is a price per GB-month, not a cost so far: nothing to agree.
Real services on PostgreSQL."""
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from billing.models import AccountKind, Entry, LedgerTransaction, TransactionKind
from billing.services.ledger import earnings_balance, ledger_reverse
from billing.tasks import usage_meter_tick
from core.money import usd_text
from marketplace.models import Instance, Volume
from marketplace.money import micros_to_usd
from marketplace.services import volumes as volume_svc
from tests.billing.helpers import fund, node, running, stop
from tests.conftest import _client_for
from tests.factories import UserFactory
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db

DISK_PRICE = 3_000_000  # USD 3 per GB-month: a disk charge of a few hundred seconds is thousands of micro-dollars


@pytest.fixture
def tick(django_capture_on_commit_callbacks):
    def run_tick():
        with django_capture_on_commit_callbacks(execute=True):
            usage_meter_tick()
    return run_tick


def _charges(what: str, object_id: int):
    """The storage charges of a disk (`what` "disk") or a volume, by their ledger key (storage_key)."""
    return LedgerTransaction.objects.filter(kind=TransactionKind.STORAGE,
                                            idempotency_key__startswith=f"storage:{what}:{object_id}:")


def _ledger_paid(owner, what: str, object_id: int) -> int:
    """What the owner's wallet paid for it, from the ledger: its storage charges and their reversals."""
    charges = _charges(what, object_id)
    wallet = Entry.objects.filter(account__kind=AccountKind.CUSTOMER_WALLET, account__user=owner)
    entries = wallet.filter(transaction__in=charges) | wallet.filter(transaction__reverses__in=charges)
    return -sum(entries.values_list("amount_micros", flat=True))


def _charged(txn) -> int:
    return -txn.entries.get(account__kind=AccountKind.CUSTOMER_WALLET).amount_micros


def _reverse_first(what: str, object_id: int, operator) -> int:
    """An operator reverses its first storage charge (as the admin's action does); what it charged."""
    first = _charges(what, object_id).order_by("created_at", "pk").first()
    assert first is not None
    reversal, created = ledger_reverse(txn=first, reason="test: billed in error", created_by=operator)
    assert created and reversal.reverses_id == first.pk
    return _charged(first)


def _usd(micros: int) -> Decimal:
    return micros_to_usd(micros)


@pytest.fixture
def disks(clock, tick):
    """Two stopped instances of one renter, their disks billed twice each; an operator reversed the first disk
    charge of one of them. (renter, provider, host, reversed, neighbour, given back)."""
    provider, renter = UserFactory(), UserFactory()
    host = node(price="1.000000", gpu_count=4, provider=provider)
    host.disk_price_per_gb_month_micros = DISK_PRICE
    host.save()
    fund(renter, "50")
    reversed_, neighbour = running(renter, host), running(renter, host)
    clock.advance(60)
    reversed_, neighbour = stop(reversed_), stop(neighbour)
    clock.advance(1000)
    tick()
    clock.advance(500)
    tick()
    assert _charges("disk", reversed_.pk).count() == 2
    back = _reverse_first("disk", reversed_.pk, UserFactory(is_staff=True))
    reversed_.refresh_from_db()
    neighbour.refresh_from_db()
    assert back > 0 and reversed_.disk_cost_micros > back  # the second charge stands
    assert _ledger_paid(renter, "disk", reversed_.pk) == reversed_.disk_cost_micros - back
    assert _ledger_paid(renter, "disk", neighbour.pk) == neighbour.disk_cost_micros > 0
    return renter, provider, host, reversed_, neighbour, back


def _detail(user, path: str) -> dict:
    answer = _client_for(user).get(path)
    assert answer.status_code == 200, answer.content
    return answer.json()


def _listed(user, path: str) -> dict[int, dict]:
    return {row["id"]: row for row in _detail(user, f"{path}?page_size=100")["results"]}


def _reads(captured) -> int:
    return sum(1 for q in captured.captured_queries if q["sql"].startswith("SELECT"))


def test_the_instances_api_says_what_the_ledger_says_the_disk_cost(disks):
    renter, provider, host, reversed_, neighbour, back = disks
    paid = _ledger_paid(renter, "disk", reversed_.pk)
    assert Decimal(_detail(renter, f"/api/v1/instances/{reversed_.pk}/")["disk_cost_so_far"]) == _usd(paid)
    rows = _listed(renter, "/api/v1/instances/")  # was disk_cost_micros, `back` more
    assert Decimal(rows[reversed_.pk]["disk_cost_so_far"]) == _usd(paid)
    # The instance beside it, nothing reversed: what was charged, which the ledger says too.
    assert Decimal(rows[neighbour.pk]["disk_cost_so_far"]) == _usd(neighbour.disk_cost_micros) \
        == _usd(_ledger_paid(renter, "disk", neighbour.pk))
    # GPU time was not reversed: cost_so_far is as charged.
    assert Decimal(rows[reversed_.pk]["cost_so_far"]) == _usd(reversed_.cost_micros)


def test_a_verbs_answer_reads_the_disk_net_too(disks, clock):
    """The start closes the disk's billing (a third charge): its 202 answer says the ledger's net of all three."""
    renter, provider, host, reversed_, neighbour, back = disks
    clock.advance(300)
    answer = _client_for(renter).post(f"/api/v1/instances/{reversed_.pk}/start/")
    assert answer.status_code == 202, answer.content
    assert _charges("disk", reversed_.pk).count() == 3
    paid = _ledger_paid(renter, "disk", reversed_.pk)
    assert Decimal(answer.json()["disk_cost_so_far"]) == _usd(paid)
    reversed_.refresh_from_db()
    assert paid == reversed_.disk_cost_micros - back


def test_the_serializer_alone_reads_the_reversal_too(disks):
    """An instance or volume serialized without the viewset's annotation (any other caller) asks once."""
    from marketplace.api.instance_serializers import InstanceSerializer

    renter, provider, host, reversed_, neighbour, back = disks
    plain = Instance.objects.get(pk=reversed_.pk)
    assert not hasattr(plain, "disk_given_back_micros")
    assert Decimal(InstanceSerializer(plain).data["disk_cost_so_far"]) == \
        _usd(_ledger_paid(renter, "disk", reversed_.pk))


def test_the_instance_page_says_what_the_ledger_says_the_disk_cost(disks):
    renter, provider, host, reversed_, neighbour, back = disks
    paid = _ledger_paid(renter, "disk", reversed_.pk)
    page = logged_in(renter).get(f"/instances/{reversed_.pk}/")
    assert page.status_code == 200
    assert page.context["cost"]["disk_amount_micros"] == paid
    assert page.context["cost"]["disk_given_back_micros"] == back
    disk_line = page.content.decode().split('id="disk">', 1)[1].split("</dd>", 1)[0]
    assert f"({usd_text(paid)} so far: {usd_text(reversed_.disk_cost_micros)} charged, {usd_text(back)} given " \
           f"back)" in disk_line, disk_line
    other = logged_in(renter).get(f"/instances/{neighbour.pk}/")
    assert other.context["cost"]["disk_amount_micros"] == neighbour.disk_cost_micros
    assert "given back" not in other.content.decode().split('id="disk">', 1)[1].split("</dd>", 1)[0]


def test_the_instance_page_reads_the_disk_in_no_more_queries(disks):
    """The disk's reversal is read in the query that read the GPU time's give-back: the page's count is the same
    whether or not anything was reversed."""
    renter, provider, host, reversed_, neighbour, back = disks
    client = logged_in(renter)
    client.get(f"/instances/{neighbour.pk}/")
    with CaptureQueriesContext(connection) as plain:
        assert client.get(f"/instances/{neighbour.pk}/").status_code == 200
    with CaptureQueriesContext(connection) as reversed_read:
        assert client.get(f"/instances/{reversed_.pk}/").status_code == 200
    assert _reads(reversed_read) == _reads(plain)


def test_the_instances_list_reads_the_reversals_in_its_own_query(disks, clock, tick):
    renter, provider, host, reversed_, neighbour, back = disks
    client = _client_for(renter)
    client.get("/api/v1/instances/")
    with CaptureQueriesContext(connection) as one:
        assert client.get("/api/v1/instances/").status_code == 200
    _reverse_first("disk", neighbour.pk, UserFactory(is_staff=True))
    third = stop(running(renter, host))
    clock.advance(700)
    tick()
    _reverse_first("disk", third.pk, UserFactory(is_staff=True))
    with CaptureQueriesContext(connection) as more:
        rows = {r["id"]: r for r in client.get("/api/v1/instances/").json()["results"]}
    # Two instances, one disk reversed; then three, all reversed: as many reads (a query per instance would add).
    assert len(rows) == 3 and _reads(more) == _reads(one)
    for instance in (neighbour, third):
        assert Decimal(rows[instance.pk]["disk_cost_so_far"]) == _usd(_ledger_paid(renter, "disk", instance.pk))
    assert Decimal(rows[third.pk]["disk_cost_so_far"]) == 0  # its one charge reversed in full


@pytest.fixture
def volumes(clock, tick):
    """Two volumes of one renter, billed twice each; an operator reversed the first charge of one."""
    provider, renter = UserFactory(), UserFactory()
    host = node(provider=provider)
    host.disk_price_per_gb_month_micros = DISK_PRICE
    host.save()
    fund(renter, "50")
    made = []
    for size in (100, 40):
        volume = volume_svc.volume_create(owner=renter, node_id=host.pk, size_gb=size)
        made.append(volume_svc.volume_mark_available(volume_id=volume.pk))
    clock.advance(1000)
    tick()
    clock.advance(500)
    tick()
    reversed_, neighbour = made
    back = _reverse_first("volume", reversed_.pk, UserFactory(is_staff=True))
    reversed_.refresh_from_db()
    neighbour.refresh_from_db()
    assert _charges("volume", reversed_.pk).count() == 2 and 0 < back < reversed_.cost_micros
    assert _ledger_paid(renter, "volume", reversed_.pk) == reversed_.cost_micros - back
    return renter, provider, host, reversed_, neighbour, back


def test_the_volumes_api_and_page_say_what_the_ledger_says_was_paid(volumes):
    from marketplace.api.volumes import VolumeSerializer

    renter, provider, host, reversed_, neighbour, back = volumes
    paid = _ledger_paid(renter, "volume", reversed_.pk)
    assert Decimal(_detail(renter, f"/api/v1/volumes/{reversed_.pk}/")["cost_so_far"]) == _usd(paid)
    rows = _listed(renter, "/api/v1/volumes/")  # was cost_micros, `back` more
    assert Decimal(rows[reversed_.pk]["cost_so_far"]) == _usd(paid)
    assert Decimal(rows[neighbour.pk]["cost_so_far"]) == _usd(neighbour.cost_micros) \
        == _usd(_ledger_paid(renter, "volume", neighbour.pk))
    assert Decimal(VolumeSerializer(Volume.objects.get(pk=reversed_.pk)).data["cost_so_far"]) == _usd(paid)
    page = logged_in(renter).get("/volumes/")
    assert page.status_code == 200
    shown = {row["volume"].pk: row for row in page.context["rows"]}
    assert shown[reversed_.pk]["paid"] == paid and shown[reversed_.pk]["volume"].given_back_micros == back
    assert shown[neighbour.pk]["paid"] == neighbour.cost_micros
    assert f"{usd_text(paid)} ({usd_text(reversed_.cost_micros)} charged, {usd_text(back)} given back)" in \
        page.content.decode()


def test_the_volumes_list_reads_the_reversals_in_its_own_query(volumes, clock, tick):
    renter, provider, host, reversed_, neighbour, back = volumes
    client = _client_for(renter)
    client.get("/api/v1/volumes/")
    with CaptureQueriesContext(connection) as one:
        assert client.get("/api/v1/volumes/").status_code == 200
    _reverse_first("volume", neighbour.pk, UserFactory(is_staff=True))
    third = volume_svc.volume_mark_available(
        volume_id=volume_svc.volume_create(owner=renter, node_id=host.pk, size_gb=10).pk)
    clock.advance(700)
    tick()
    _reverse_first("volume", third.pk, UserFactory(is_staff=True))
    with CaptureQueriesContext(connection) as more:
        rows = {r["id"]: r for r in client.get("/api/v1/volumes/").json()["results"]}
    # Two volumes, one charge reversed; then three, each with one: as many reads.
    assert len(rows) == 3 and _reads(more) == _reads(one)
    for volume in (neighbour, third):
        assert Decimal(rows[volume.pk]["cost_so_far"]) == _usd(_ledger_paid(renter, "volume", volume.pk))


def test_the_providers_earnings_agree_with_the_ledger_after_a_storage_reversal(disks, clock, tick):
    """Coverage: the provider's figures were already read from the ledger net of reversals (passes on the old
    code too)."""
    renter, provider, host, reversed_, neighbour, back = disks
    volume = volume_svc.volume_mark_available(
        volume_id=volume_svc.volume_create(owner=renter, node_id=host.pk, size_gb=20).pk)
    clock.advance(900)
    tick()
    _reverse_first("volume", volume.pk, UserFactory(is_staff=True))
    earned = earnings_balance(user_id=provider.pk)
    rows = Entry.objects.filter(account__user=provider, account__kind=AccountKind.PROVIDER_EARNINGS)
    assert earned == sum(rows.values_list("amount_micros", flat=True))
    answer = _client_for(provider).get("/api/v1/billing/earnings/")
    assert answer.status_code == 200, answer.content
    assert Decimal(answer.json()["earned"]) == _usd(earned)
    paid = sum(_ledger_paid(renter, what, pk) for what, pk in (
        ("disk", reversed_.pk), ("disk", neighbour.pk), ("volume", volume.pk)))
    gpu = -sum(Entry.objects.filter(account__user=renter, account__kind=AccountKind.CUSTOMER_WALLET,
                                    transaction__kind=TransactionKind.USAGE).values_list("amount_micros", flat=True))
    assert Decimal(answer.json()["renters_paid"]) == _usd(paid + gpu)
    page = logged_in(provider).get("/earnings/")
    [row] = [r for r in page.context["nodes"] if r["node"].pk == host.pk]
    assert row["earned_micros"] == earned
