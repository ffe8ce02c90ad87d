"""core.sql.constraint_violated: which constraint an IntegrityError broke is read by name from PostgreSQL's
diagnostics, never found in str(exc). PostgreSQL's message carries a DETAIL line with the offending values (a unique
key's columns, or the whole failing row of a CHECK violation), which may be anyone's input: before, a value that
spelled another constraint's name was taken for that constraint. Each service that maps a constraint to an answer
is checked with real PostgreSQL errors: one of the constraint it maps (mapped as before), and one of another
constraint whose DETAIL spells that name (re-raised, not mapped). No SSH, no sim node."""
import itertools
from contextlib import contextmanager
from datetime import timedelta
from decimal import Decimal

import psycopg
import pytest
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from core.errors import Conflict, ValidationFailed
from core.sql import constraint_violated
from marketplace.models import GpuAllocation, MigSlice, MigSliceAllocation, Node, SliceStatus, SshKey
from marketplace.services.instances import allocation, mig
from marketplace.services.ssh_keys import SshKeyExists, ssh_key_create
from provisioning.models import Job, JobKind, NodeEvent
from provisioning.services import jobs
from provisioning.services import nodes as provisioning_nodes
from provisioning.services.jobs import JobConflict, job_create
from provisioning.services.mig import node_apply_mig_slices
from provisioning.services.nodes import DuplicateHardware, node_apply_inventory
from tests.factories import UserFactory, make_listed_node, make_node
from tests.marketplace.mig_helpers import make_mig_node, slice_uuid
from tests.marketplace.renting_helpers import (
    book,
    ed25519_key,
    sent_jobs_fixture,  # noqa: F401 (autouse: no job leaves)
)

pytestmark = pytest.mark.django_db

_probe = itertools.count()


def pg_violation(constraint: str, value: str) -> IntegrityError:
    """A real unique violation from PostgreSQL, of a constraint named `constraint` (on a temporary table), whose
    DETAIL quotes `value`: `Key (v)=(<value>) already exists.`"""
    table = f"constraint_probe_{next(_probe)}"
    insert = f"INSERT INTO {table} VALUES (%s)"  # noqa: S608 (the test's own names)
    with connection.cursor() as cursor:
        cursor.execute(f'CREATE TEMP TABLE {table} (v text, CONSTRAINT "{constraint}" UNIQUE (v))')
        cursor.execute(insert, [value])
        try:
            with transaction.atomic():
                cursor.execute(insert, [value])
        except IntegrityError as exc:
            return exc
    raise AssertionError("no violation")


def named(constraint: str) -> IntegrityError:
    """A violation of `constraint` itself."""
    return pg_violation(constraint, "some value")


def spelled(constraint: str) -> IntegrityError:
    """A violation of another constraint, whose DETAIL spells `constraint`."""
    exc = pg_violation(f"another_constraint_{next(_probe)}", f"x {constraint} y")
    assert constraint in str(exc) and constraint_violated(exc) != constraint
    return exc


def raises(exc: Exception):
    def raiser(*args, **kwargs):
        raise exc
    return raiser


# The helper.

def test_the_name_comes_from_postgresqls_diagnostics_not_the_text():
    provider = UserFactory()
    make_node(provider, address="10.0.0.9", ssh_port=2222)
    other = make_node(provider, address="10.0.0.9")
    with pytest.raises(IntegrityError) as raised, transaction.atomic():  # a partial unique index's violation
        Node.objects.filter(pk=other.pk).update(ssh_port=2222)
    assert constraint_violated(raised.value) == "node_unique_own_live_endpoint"
    assert isinstance(raised.value.__cause__, psycopg.errors.UniqueViolation)
    assert constraint_violated(raised.value.__cause__) == "node_unique_own_live_endpoint"  # psycopg's own
    with pytest.raises(IntegrityError) as raised, transaction.atomic():  # a CHECK's: the whole row in DETAIL
        Node.objects.filter(provider=provider).update(name="node_unique_own_live_host_key", gpu_count=0)
    assert "node_unique_own_live_host_key" in str(raised.value)
    assert constraint_violated(raised.value) == "node_gpu_count_positive"
    spelling = pg_violation("probe_own_name", "sshkey_unique_per_user")
    assert "sshkey_unique_per_user" in str(spelling) and constraint_violated(spelling) == "probe_own_name"
    # Where the database does not name it (SQLite names the columns), or an error built by hand: "".
    assert constraint_violated(IntegrityError("UNIQUE constraint failed: marketplace_sshkey.user_id")) == ""
    assert constraint_violated(IntegrityError("sshkey_unique_per_user")) == ""


# A provider's node registration (marketplace.services.nodes._node_create): real errors only.

def test_registration_maps_its_own_constraints():
    provider = UserFactory()
    key = "SHA256:" + "B" * 43
    make_node(provider, address="10.0.0.7", ssh_port=2200, host_key_fingerprint=key)
    with pytest.raises(Conflict, match="already registered at 10.0.0.7:2200"):
        make_node(provider, address="10.0.0.7", ssh_port=2200, name="node_unique_own_live_host_key")
    with pytest.raises(ValidationFailed) as raised:
        make_node(provider, address="10.0.0.7", ssh_port=2201, host_key_fingerprint=key,
                  name="node_unique_own_live_endpoint")
    assert raised.value.field == "host_key_fingerprint"


@pytest.mark.parametrize("name", ["node_unique_own_live_endpoint", "node_unique_own_live_host_key"])
def test_a_node_named_after_a_constraint_is_not_taken_for_that_constraint(name):
    # A CHECK violation (no GPU) quotes the whole row, its name too: before, a 409 "already registered" or a 400 on
    # the host key, for a node no other node conflicts with.
    with pytest.raises(IntegrityError) as raised:
        make_node(UserFactory(), name=name, gpu_count=0)
    assert constraint_violated(raised.value) == "node_gpu_count_positive"
    assert not Node.objects.filter(name=name).exists()


# The other sites, each with its write made to raise a real PostgreSQL error.

def test_ssh_key_create(monkeypatch):
    user = UserFactory()
    monkeypatch.setattr(SshKey, "save", raises(named("sshkey_unique_per_user")))
    with pytest.raises(SshKeyExists):
        ssh_key_create(user=user, public_key=ed25519_key())
    monkeypatch.setattr(SshKey, "save", raises(spelled("sshkey_unique_per_user")))
    with pytest.raises(IntegrityError):
        ssh_key_create(user=user, public_key=ed25519_key())


def test_job_create(monkeypatch):
    node = make_node()
    for constraint in ("job_one_open_per_instance_and_kind", "job_one_open_node_job_per_node"):
        monkeypatch.setattr(jobs, "_insert_job", raises(named(constraint)))
        with pytest.raises(JobConflict):
            job_create(kind=JobKind.NODE_VERIFY, node=node)
    monkeypatch.setattr(jobs, "_insert_job", raises(spelled("job_one_open_node_job_per_node")))
    with pytest.raises(IntegrityError):
        job_create(kind=JobKind.NODE_VERIFY, node=node)
    assert not Job.objects.filter(node=node).exists()


def test_node_apply_inventory(monkeypatch):
    node = make_node(runtime="libvirt")
    inventory = {"gpus": [{"index": 0, "uuid": "GPU-11111111-2222-3333-4444-555555555555"}]}

    def apply(error):
        def _apply(node_id, inventory, *, claim):
            if claim:
                raise error
            return True  # applied: the node was not retired meanwhile
        return _apply

    monkeypatch.setattr(provisioning_nodes, "_apply_inventory", apply(named("gpu_unique_uuid")))
    with pytest.raises(DuplicateHardware):
        node_apply_inventory(node=node, inventory=inventory)
    monkeypatch.setattr(provisioning_nodes, "_apply_inventory", apply(spelled("gpu_unique_uuid")))
    with pytest.raises(IntegrityError):
        node_apply_inventory(node=node, inventory=inventory)


def test_node_apply_mig_slices(monkeypatch):
    node = make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=1,
                            mig_layout=[{"gpu": 0, "profiles": ["7g.80gb"]}], mig_prices={"7g.80gb": Decimal("1")})
    slices = [{"gpu": 0, "device": 0, "profile": "7g.80gb", "uuid": slice_uuid(node.pk, 0, 0), "memory_mib": 80896,
               "proven": True}]

    def apply() -> None:
        with transaction.atomic():
            node_apply_mig_slices(node=Node.objects.select_for_update().get(pk=node.pk), slices=slices,
                                  listable=True)

    monkeypatch.setattr(MigSlice, "save", raises(named("mig_slice_unique_uuid")))
    apply()  # the same card listed twice: told, not raised
    assert NodeEvent.objects.filter(node=node, kind="mig_slices_duplicate").exists()
    monkeypatch.setattr(MigSlice, "save", raises(spelled("mig_slice_unique_uuid")))
    with pytest.raises(IntegrityError):
        apply()


def test_allocate_on_start(monkeypatch):
    manager = GpuAllocation.objects
    monkeypatch.setattr(manager, "bulk_create", raises(named("gpu_in_at_most_one_live_allocation")))
    with pytest.raises(Conflict, match="taken by another booking"):
        allocation._allocate(None, [], timezone.now())
    monkeypatch.setattr(manager, "bulk_create", raises(spelled("gpu_in_at_most_one_live_allocation")))
    with pytest.raises(IntegrityError):
        allocation._allocate(None, [], timezone.now())


def test_a_bookings_statement(monkeypatch):
    renter, node = UserFactory(), make_listed_node(gpu_count=2)

    real = allocation.prepared_cursor

    def cursor_raising(error):
        class Cursor:  # the booking's statement (its allocations' INSERT) raises; the node's lock runs
            def __init__(self, cursor):
                self.cursor = cursor

            def execute(self, sql, params):
                if "alloc AS (INSERT" in sql:
                    raise error
                return self.cursor.execute(sql, params)

            def __getattr__(self, name):
                return getattr(self.cursor, name)

        @contextmanager
        def prepared_cursor():
            with real() as cursor:
                yield Cursor(cursor)
        return prepared_cursor

    monkeypatch.setattr(allocation, "prepared_cursor", cursor_raising(named("gpu_in_at_most_one_live_allocation")))
    with pytest.raises(Conflict, match="taken by another booking"):
        book(renter, node)
    monkeypatch.setattr(allocation, "prepared_cursor", cursor_raising(spelled("gpu_in_at_most_one_live_allocation")))
    with pytest.raises(IntegrityError):
        book(renter, node)


def test_a_mig_instances_slices_taken_again(monkeypatch):
    renter, node = UserFactory(), make_mig_node({0: ["7g.80gb"]}, gpu_count=1)
    instance = book(renter, node, num_gpus=1, mig_profile="7g.80gb")
    released = timezone.now()
    MigSliceAllocation.objects.filter(instance=instance).update(released_at=released)
    MigSlice.objects.filter(node=node).update(status=SliceStatus.FREE)
    manager = MigSliceAllocation.objects
    at = released + timedelta(seconds=1)
    monkeypatch.setattr(manager, "bulk_create", raises(named("mig_slice_in_at_most_one_live_allocation")))
    with pytest.raises(Conflict), transaction.atomic():
        mig.reallocate_slices(instance, at)
    monkeypatch.setattr(manager, "bulk_create", raises(spelled("mig_slice_in_at_most_one_live_allocation")))
    with pytest.raises(IntegrityError), transaction.atomic():
        mig.reallocate_slices(instance, at)
