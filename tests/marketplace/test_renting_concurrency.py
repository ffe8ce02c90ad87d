"""Real races on PostgreSQL: parallel requests, each on its own connection, for the same few GPUs.

These tests commit (transaction=True); the data the migrations seed (GPU catalogue, images) is
put back after each flush by the `_reference_data` fixture of tests/conftest.py.
"""
import random
import threading
import time
from collections import Counter

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from billing.services.ledger import credit_grant
from core.errors import Conflict, IdempotencyKeyReused
from marketplace.models import Gpu, GpuAllocation, GpuStatus, Image, Instance
from marketplace.services import instances as svc
from provisioning.models import Job
from tests.factories import UserFactory, api_key_for, make_listed_node

from .renting_helpers import book, ed25519_key, run, sent_jobs_fixture, snapshot  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/api/v1/instances/"


def client_for(user) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key_for(user)}")
    return client


def in_parallel(calls: list) -> list:
    """Run the callables at the same moment, each in its own thread and database connection."""
    barrier = threading.Barrier(len(calls))
    results: list = [None] * len(calls)

    def worker(i, call):
        try:
            barrier.wait(timeout=10)
            results[i] = call()
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            results[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=worker, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert not [r for r in results if isinstance(r, Exception)], results
    return results


def assert_consistent():
    """No GPU in two live allocations; a GPU is rented exactly when it is in a live allocation."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT gpu_id FROM marketplace_gpuallocation WHERE released_at IS NULL "
            "GROUP BY gpu_id HAVING count(*) > 1"
        )
        assert cur.fetchall() == []
        cur.execute(
            "SELECT g.id, g.status FROM marketplace_gpu g LEFT JOIN marketplace_gpuallocation a "
            "ON a.gpu_id = g.id AND a.released_at IS NULL WHERE (g.status = 'rented') <> (a.id IS NOT NULL)"
        )
        assert cur.fetchall() == []
        cur.execute(
            "SELECT i.id FROM marketplace_instance i WHERE i.status IN ('requested', 'provisioning', 'running') "
            "AND i.num_gpus <> (SELECT count(*) FROM marketplace_gpuallocation a "
            "WHERE a.instance_id = i.id AND a.released_at IS NULL)"
        )
        assert cur.fetchall() == []


def booking(client, node, num_gpus=1, key=None, label=""):
    data = {"offer": node.pk, "num_gpus": num_gpus, "image": "cuda-12-4", "ssh_public_key": ed25519_key(),
            "label": label}
    headers = {"HTTP_IDEMPOTENCY_KEY": key} if key else {}
    return lambda: client.post(URL, data, format="json", **headers)


def test_sixteen_clients_race_for_four_gpus(sent_jobs):
    node = make_listed_node(gpu_count=4)
    clients = [client_for(UserFactory()) for _ in range(16)]
    responses = in_parallel([booking(c, node) for c in clients])
    codes = Counter(r.status_code for r in responses)
    assert codes == {201: 4, 409: 12}, codes
    for r in responses:
        if r.status_code == 409:
            assert "free on this node" in r.json()["detail"]
    won = sorted(g for r in responses if r.status_code == 201 for g in r.json()["gpus"])
    assert won == [0, 1, 2, 3]
    assert Instance.objects.count() == 4
    assert GpuAllocation.objects.filter(released_at__isnull=True).count() == 4
    assert set(Gpu.objects.filter(node=node).values_list("status", flat=True)) == {GpuStatus.RENTED}
    assert_consistent()
    assert sorted(kind for _, kind in sent_jobs) == ["instance_provision"] * 4  # queued on commit, once each


def test_mixed_sizes_never_overbook():
    rng = random.Random(7)
    node = make_listed_node(gpu_count=4)
    clients = [client_for(UserFactory()) for _ in range(14)]
    sizes = [rng.choice([1, 2]) for _ in clients]
    responses = in_parallel([booking(c, node, n) for c, n in zip(clients, sizes, strict=True)])
    assert {r.status_code for r in responses} <= {201, 409}
    booked = [(n, r.json()) for n, r in zip(sizes, responses, strict=True) if r.status_code == 201]
    assert booked and sum(n for n, _ in booked) <= 4
    for n, inst in booked:
        assert len(inst["gpus"]) == n
    rented = Gpu.objects.filter(node=node, status=GpuStatus.RENTED).count()
    assert rented == sum(n for n, _ in booked) == GpuAllocation.objects.filter(released_at__isnull=True).count()
    assert_consistent()


def test_bookings_and_destroys_racing_on_two_nodes():
    nodes = [make_listed_node(gpu_count=2), make_listed_node(gpu_count=2)]
    renter = UserFactory()
    held = [run(book(renter, nodes[0], num_gpus=1)), run(book(renter, nodes[1], num_gpus=1))]
    clients = [client_for(UserFactory()) for _ in range(10)]

    def destroy(inst):
        def call():
            svc.instance_destroy(instance=inst)
            return svc.instance_mark_destroyed(instance_id=inst.pk)
        return call

    calls = [booking(c, nodes[i % 2]) for i, c in enumerate(clients)] + [destroy(i) for i in held]
    in_parallel(calls)
    for node in nodes:
        live = GpuAllocation.objects.filter(gpu__node=node, released_at__isnull=True).count()
        assert live <= 2
    assert_consistent()


def test_start_racing_with_new_bookings_never_double_allocates(user):
    node = make_listed_node(gpu_count=3)
    inst = run(book(user, node, num_gpus=2))
    svc.instance_stop(instance=inst)
    svc.instance_mark_stopped(instance_id=inst.pk)
    clients = [client_for(UserFactory()) for _ in range(6)]

    def start():
        try:
            return svc.instance_start(instance=inst).status
        except Conflict as exc:
            return str(exc)

    results = in_parallel([start] + [booking(c, node) for c in clients])
    started = results[0] == "starting"
    booked = sum(1 for r in results[1:] if r.status_code == 201)
    assert booked + (2 if started else 0) <= 3
    assert Gpu.objects.filter(node=node, status=GpuStatus.RENTED).count() == booked + (2 if started else 0)
    assert_consistent()


def test_identical_requests_with_one_idempotency_key_create_one_instance(sent_jobs):
    node = make_listed_node(gpu_count=8)
    user = UserFactory()
    data = {"offer": node.pk, "num_gpus": 1, "image": "cuda-12-4", "ssh_public_key": ed25519_key()}
    clients = [client_for(user) for _ in range(8)]
    call = [lambda c=c: c.post(URL, data, format="json", HTTP_IDEMPOTENCY_KEY="once") for c in clients]
    responses = in_parallel(call)
    codes = Counter(r.status_code for r in responses)
    assert codes == {201: 1, 200: 7}, codes
    assert len({r.json()["id"] for r in responses}) == 1
    assert Instance.objects.count() == 1
    assert Gpu.objects.filter(node=node, status=GpuStatus.RENTED).count() == 1
    assert len(sent_jobs) == 1
    assert_consistent()


def _waiting_for_a_lock(pid) -> bool:
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_locks WHERE pid = %s AND NOT granted", [pid])
        return cur.fetchone()[0] > 0


@pytest.mark.parametrize("same_body", [True, False])
def test_the_unique_constraint_decides_an_idempotency_race(same_body):
    """The loser passed the "already exists?" check before the winner committed; the index stops it."""
    node = make_listed_node(gpu_count=4)
    user = UserFactory()
    image = svc.Image.objects.get(slug="cuda-12-4")
    keys = [ed25519_key()]
    args = {"renter": user, "node_id": node.pk, "image": image, "ssh_public_keys": keys,
            "idempotency_key": "race", "request_fingerprint": "a" * 64}
    winner_inserted, release = threading.Event(), threading.Event()
    outcome = {}

    def winner():
        try:
            with transaction.atomic():
                outcome["winner"] = svc.instance_create(num_gpus=1, **args)[0]
                winner_inserted.set()
                release.wait(10)
        finally:
            connection.close()

    def loser():
        try:
            connection.ensure_connection()
            outcome["pid"] = connection.connection.info.backend_pid
            winner_inserted.wait(10)
            fingerprint = args["request_fingerprint"] if same_body else "b" * 64
            outcome["loser"] = svc.instance_create(num_gpus=1, **{**args, "request_fingerprint": fingerprint})
        except Exception as exc:  # noqa: BLE001
            outcome["loser"] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=winner), threading.Thread(target=loser)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    # Wait until the loser is blocked on the winner's entry in the unique index.
    while "pid" not in outcome or not _waiting_for_a_lock(outcome["pid"]):
        assert time.monotonic() < deadline, "the second request never reached the insert"
        time.sleep(0.01)
    release.set()
    for t in threads:
        t.join(10)
    if same_body:
        instance, created = outcome["loser"]
        assert not created and instance.pk == outcome["winner"].pk
    else:
        assert isinstance(outcome["loser"], IdempotencyKeyReused)
    assert Instance.objects.count() == 1
    assert Gpu.objects.filter(node=node, status=GpuStatus.RENTED).count() == 1
    assert_consistent()


def test_a_booking_in_flight_holds_off_retiring_its_node():
    """The share lock on the node: the provider's retire waits for the booking, then sees the rented GPU."""
    from marketplace.services.nodes import node_retire

    node = make_listed_node(gpu_count=2)
    user = UserFactory()
    booked, release = threading.Event(), threading.Event()
    outcome = {}

    def renter():
        try:
            with transaction.atomic():
                book(user, node)
                booked.set()
                release.wait(10)
        finally:
            connection.close()

    def provider():
        try:
            connection.ensure_connection()
            outcome["pid"] = connection.connection.info.backend_pid
            booked.wait(10)
            node_retire(node=node)
            outcome["retire"] = "retired"
        except Conflict as exc:
            outcome["retire"] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=renter), threading.Thread(target=provider)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while "pid" not in outcome or not _waiting_for_a_lock(outcome["pid"]):
        assert time.monotonic() < deadline, "retire did not wait for the booking"
        time.sleep(0.01)
    release.set()
    for t in threads:
        t.join(10)
    assert isinstance(outcome["retire"], Conflict)
    node.refresh_from_db()
    assert node.state == "active"
    assert_consistent()


def test_a_booking_is_one_short_transaction_without_savepoints(user, sent_jobs, settings):
    """The statements of one booking (issue 14): the node's share lock with its GPU count and the wallet's lock (the
    funds check's) in one; the renter's burn rate, the instance with its GPUs locked, rented and allocated, and its
    job in another; no SAVEPOINT, no read the booking does not need. The job is handed over after COMMIT."""
    settings.BILLING_REQUIRE_FUNDS = True
    credit_grant(user=user, amount_micros=100_000_000, reason="test")
    node = make_listed_node(gpu_count=2)
    image, keys = Image.objects.get(slug="cuda-12-4"), [ed25519_key()]
    with CaptureQueriesContext(connection) as captured:
        instance, _ = svc.instance_create(renter=user, node_id=node.pk, num_gpus=2, image=image, ssh_public_keys=keys)
    statements = [q["sql"].split(None, 1)[0].upper() for q in captured.captured_queries]
    assert "SAVEPOINT" not in statements and "RELEASE" not in statements, statements
    assert statements == ["BEGIN", "WITH", "WITH", "COMMIT"], statements
    locks, booking = captured.captured_queries[1]["sql"], captured.captured_queries[2]["sql"]
    assert locks.startswith("WITH node_row AS (SELECT") and "FOR SHARE OF n" in locks and "FOR UPDATE" in locks
    assert booking.startswith("WITH rate AS (SELECT COALESCE(SUM(i.price_per_hour_micros) FILTER")
    assert "size_gb::numeric * price_per_gb_month_micros" in booking  # the renter's storage counts too
    assert 'inst AS (INSERT INTO "marketplace_instance"' in booking
    assert 'job AS (INSERT INTO "provisioning_job"' in booking
    assert sent_jobs == [(Job.objects.get(instance=instance).pk, "instance_provision")]
    assert sorted(GpuAllocation.objects.filter(instance=instance).values_list("gpu__index", flat=True)) == [0, 1]
    assert_consistent()


def test_a_refused_booking_leaves_nothing_behind(user, sent_jobs):
    """Without savepoints, a 409 from the one-statement allocation (fewer GPUs free than asked) and a 409 from the
    database's own guarantee roll the whole booking back."""
    node = make_listed_node(gpu_count=2)
    book(UserFactory(), node, num_gpus=1)
    before = snapshot(node)
    with pytest.raises(Conflict, match="Only 1 GPU is free on this node now; you asked for 2"):
        book(user, node, num_gpus=2)
    # A GPU marked free while it is still allocated (a bug elsewhere): the partial unique index refuses it.
    Gpu.objects.filter(node=node).update(status=GpuStatus.FREE)
    with pytest.raises(Conflict, match="taken by another booking meanwhile"):
        book(user, node, num_gpus=2)
    Gpu.objects.filter(node=node, index=0).update(status=GpuStatus.RENTED)
    assert snapshot(node) == before and len(sent_jobs) == 1
