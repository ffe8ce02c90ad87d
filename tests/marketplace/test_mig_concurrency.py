"""Real races on PostgreSQL for MIG slices: a slice and its parent GPU are never in two live allocations at once.

Threads on their own connections book slices, book the whole GPU, and (as a check that found the layout gone
would) take the GPU back to whole renting, all at the same moment; afterwards the database must hold no GPU that is
both allocated whole and has a slice allocated, no slice in two live allocations, and every status must agree with
the allocations.
"""
from collections import Counter

import pytest
from django.db import connection, transaction

from marketplace.models import GpuStatus, MigSlice, MigSliceAllocation, Node
from provisioning.services.mig import node_apply_mig_slices
from tests.factories import UserFactory

from .mig_helpers import SEVEN, make_mig_node
from .renting_helpers import ed25519_key, sent_jobs_fixture  # noqa: F401
from .test_renting_concurrency import client_for, in_parallel

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/api/v1/instances/"


def assert_parent_rule_holds():
    with connection.cursor() as cur:
        # no GPU both allocated whole and holding an allocated slice
        cur.execute(
            "SELECT g.id FROM marketplace_gpu g WHERE EXISTS (SELECT 1 FROM marketplace_gpuallocation a "
            "WHERE a.gpu_id = g.id AND a.released_at IS NULL) AND EXISTS (SELECT 1 FROM marketplace_migslice s "
            "JOIN marketplace_migsliceallocation sa ON sa.mig_slice_id = s.id AND sa.released_at IS NULL "
            "WHERE s.gpu_id = g.id)")
        assert cur.fetchall() == []
        # a slice is rented exactly when it is in one live allocation
        cur.execute(
            "SELECT s.id FROM marketplace_migslice s LEFT JOIN marketplace_migsliceallocation sa "
            "ON sa.mig_slice_id = s.id AND sa.released_at IS NULL GROUP BY s.id, s.status "
            "HAVING count(sa.id) > 1 OR (s.status = 'rented') <> (count(sa.id) = 1)")
        assert cur.fetchall() == []
        # a GPU with an allocated slice is split; one allocated whole is rented
        cur.execute(
            "SELECT DISTINCT g.id FROM marketplace_gpu g JOIN marketplace_migslice s ON s.gpu_id = g.id "
            "JOIN marketplace_migsliceallocation sa ON sa.mig_slice_id = s.id AND sa.released_at IS NULL "
            "WHERE g.status <> 'mig'")
        assert cur.fetchall() == []


def slice_booking(client, node, profile="1g.10gb", count=1):
    data = {"offer": node.pk, "num_gpus": count, "mig_profile": profile, "image": "cuda-12-4",
            "ssh_public_key": ed25519_key()}
    return lambda: client.post(URL, data, format="json")


def whole_booking(client, node):
    data = {"offer": node.pk, "num_gpus": 1, "image": "cuda-12-4", "ssh_public_key": ed25519_key()}
    return lambda: client.post(URL, data, format="json")


def unsplit(node):
    """The provider dropped the layout and the check saw it: the GPU goes back to whole renting if it can."""
    def call():
        with transaction.atomic():
            locked = Node.objects.select_for_update().get(pk=node.pk)
            locked.mig_layout = []
            locked.save(update_fields=["mig_layout"])
            node_apply_mig_slices(node=locked, slices=[], listable=True)
        return "unsplit"
    return call


def test_twelve_clients_race_for_seven_slices():
    node = make_mig_node({0: SEVEN}, gpu_count=1)
    responses = in_parallel([slice_booking(client_for(UserFactory()), node) for _ in range(12)])
    codes = Counter(r.status_code for r in responses)
    assert codes[201] == 7 and codes[201] + codes[409] + codes[400] == 12, codes
    won = [u for r in responses if r.status_code == 201 for u in r.json()["mig_slices"]]
    assert sorted(won) == sorted(MigSlice.objects.values_list("uuid", flat=True))
    assert_parent_rule_holds()


@pytest.mark.parametrize("round_", range(4))
def test_slices_whole_bookings_and_unsplitting_race_without_breaking_the_parent_rule(round_):
    node = make_mig_node({0: SEVEN}, gpu_count=1)
    calls = [slice_booking(client_for(UserFactory()), node) for _ in range(4)]
    calls += [whole_booking(client_for(UserFactory()), node) for _ in range(3)]
    calls.insert(round_, unsplit(node))  # its place in the start order varies from round to round
    results = in_parallel(calls)
    responses = [r for r in results if r != "unsplit"]
    assert {r.status_code for r in responses} <= {201, 400, 409}, [r.content for r in responses]
    assert_parent_rule_holds()
    gpu = node.gpus.get()
    sliced = MigSliceAllocation.objects.filter(released_at__isnull=True).count()
    whole = sum(1 for r in responses if r.status_code == 201 and not r.json()["mig_profile"])
    if sliced:  # slice bookings got in first: the GPU stayed split, nobody has it whole
        assert gpu.status == GpuStatus.MIG and whole == 0
    else:  # the GPU went back to whole renting: at most one renter has it
        assert whole <= 1 and gpu.status == (GpuStatus.RENTED if whole else GpuStatus.FREE)
