"""Declared state machines (core.transitions): the helper, every stateful model on a table, the database's copy of
the rules, and the pages' buttons read from the same table as the services."""
import importlib

import pytest
from django.apps import apps
from django.core.exceptions import ValidationError
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from billing.models import TopUp, TopUpStatus
from core.errors import Conflict
from core.transitions import InvalidTransition, StatefulModel, Transitions
from marketplace.models import Gpu, GpuStatus, Instance, Node, NodeState
from marketplace.models import InvalidTransition as ReExported
from marketplace.models.renting import INSTANCE_TRANSITIONS, InstanceStatus
from marketplace.services import instances as svc
from marketplace.web.instances import VERBS
from provisioning.models import Job, JobKind, JobStatus
from provisioning.services.jobs import JobConflict, job_create
from tests.factories import UserFactory, make_listed_node, make_node
from tests.marketplace.renting_helpers import book, run, sent_jobs_fixture  # noqa: F401
from tests.web.conftest import logged_in

STATE_FIELDS = ("status", "state", "outcome")
TABLE = Transitions({"a": {"b"}, "b": {"a", "c"}, "c": set()}, actions={"finish": ("c", None), "undo": ("a", {"b"})})


# ------------------------------------------------------------------------------------------------ the helper

def test_a_table_answers_what_may_follow():
    assert TABLE["a"] == {"b"} and set(TABLE) == {"a", "b", "c"}
    assert TABLE.can("a", "b") and not TABLE.can("a", "c") and not TABLE.can("nowhere", "a")
    assert TABLE.sources_of("a") == {"b"} and TABLE.sources_of("b") == {"a"}
    assert TABLE.final == {"c"}
    assert TABLE.action_target("finish") == "c" and TABLE.action_sources("finish") == {"b"}
    assert TABLE.action_allowed("undo", "b") and not TABLE.action_allowed("undo", "a")


def test_a_refused_move_is_a_409_conflict_that_says_what():
    with pytest.raises(InvalidTransition) as caught:
        TABLE.check("thing 5", "a", "c")
    assert isinstance(caught.value, Conflict) and caught.value.status_code == 409
    assert str(caught.value) == "thing 5 cannot go from a to c"
    assert (caught.value.current, caught.value.target) == ("a", "c")
    assert ReExported is InvalidTransition  # one definition, re-exported by marketplace.models


def test_a_table_refuses_undeclared_states_and_impossible_actions():
    with pytest.raises(ValueError, match="undeclared"):
        Transitions({"a": {"b"}})
    with pytest.raises(ValueError, match="cannot go to"):
        Transitions({"a": {"b"}, "b": set()}, actions={"back": ("a", {"b"})})


def test_a_model_moves_only_along_its_table():
    node = Node(state=NodeState.RETIRED)
    with pytest.raises(InvalidTransition, match="node None cannot go from retired to active"):
        node.transition_to(NodeState.ACTIVE)
    instance = Instance(status=InstanceStatus.RUNNING)
    instance.transition_to(InstanceStatus.STOPPING, "Waiting")
    assert (instance.status, instance.status_message) == ("stopping", "Waiting")


# ------------------------------------------------------------------------------- every stateful model declared

def _stateful_models():
    for app in ("marketplace", "billing", "provisioning"):
        for model in apps.get_app_config(app).get_models():
            for field in model._meta.concrete_fields:
                if field.name in STATE_FIELDS:
                    yield model, field


def test_every_model_with_a_state_field_is_on_a_declared_table():
    found = list(_stateful_models())
    assert {m.__name__ for m, _ in found} >= {"Node", "Gpu", "Instance", "Interruption", "Job", "TopUp", "Refund",
                                               "StripeEvent", "Payout"}
    for model, field in found:
        assert issubclass(model, StatefulModel), f"{model.__name__}.{field.name} has no transition table"
        assert model.state_field == field.name
        choices = {value for value, _ in field.choices} | ({""} if field.blank else set())
        assert set(model.transitions) == choices, model.__name__
        # ... and the database knows the states.
        names = {c.name for c in model._meta.constraints}
        assert any(name.endswith("_declared") for name in names), model.__name__


def test_the_instance_verbs_are_moves_of_the_table():
    assert set(VERBS) == set(INSTANCE_TRANSITIONS.actions)
    assert INSTANCE_TRANSITIONS.action_sources("destroy") == set(InstanceStatus) - {"destroying", "destroyed"}


# ----------------------------------------------------------------------------------------------- the database

@pytest.mark.django_db
def test_the_database_refuses_a_state_nobody_declared():
    node = make_node()
    with pytest.raises(IntegrityError), transaction.atomic():
        Node.objects.filter(pk=node.pk).update(state="sleeping")


@pytest.mark.django_db
def test_a_finished_job_has_finished_at_and_a_credited_top_up_its_transaction():
    node = make_node()
    with pytest.raises(IntegrityError), transaction.atomic():
        Job.objects.create(kind=JobKind.NODE_VERIFY, node=node, status=JobStatus.SUCCEEDED, deadline=timezone.now())
    with pytest.raises(IntegrityError), transaction.atomic():
        TopUp.objects.create(user=node.provider, amount_micros=1_000_000, status=TopUpStatus.SUCCEEDED)


@pytest.mark.django_db
def test_one_open_job_per_instance_and_kind(user):
    instance = book(user, make_listed_node(gpu_count=2))
    provision = Job.objects.get(instance=instance)
    with pytest.raises(JobConflict) as caught, transaction.atomic():
        job_create(kind=JobKind.INSTANCE_PROVISION, node=instance.node, instance=instance)
    assert caught.value.status_code == 409 and f"instance {instance.pk}" in caught.value.message
    # Another kind may overlap by design (destroy while it is still provisioning) ...
    svc.instance_destroy(instance=instance)
    assert Job.objects.filter(instance=instance).count() == 2
    # ... and once the job is closed, the same kind may be queued again.
    Job.objects.filter(pk=provision.pk).update(status=JobStatus.FAILED, finished_at=timezone.now())
    job_create(kind=JobKind.INSTANCE_PROVISION, node=instance.node, instance=instance)


@pytest.mark.django_db
def test_one_open_verification_per_node():
    node = make_node()
    job_create(kind=JobKind.NODE_VERIFY, node=node)
    with pytest.raises(JobConflict), transaction.atomic():
        job_create(kind=JobKind.NODE_VERIFY, node=node)


@pytest.mark.django_db
def test_a_verb_meeting_an_open_job_of_its_kind_is_a_clean_409_and_changes_nothing(api, user):
    """A stop asked while an earlier stop job is still open (its worker lost after stopping the VM, say)."""
    instance = run(book(user, make_listed_node(gpu_count=2)))
    Job.objects.create(kind=JobKind.INSTANCE_STOP, node=instance.node, instance=instance, status=JobStatus.RUNNING,
                       deadline=timezone.now())
    r = api.post(f"/api/v1/instances/{instance.pk}/stop/")
    assert r.status_code == 409 and "still under way" in r.json()["detail"]
    assert Instance.objects.get(pk=instance.pk).status == "running"


@pytest.mark.django_db
def test_set_based_moves_follow_the_table():
    node = make_node(gpu_count=3)
    gpus = list(node.gpus.order_by("index"))
    Gpu.objects.filter(pk=gpus[2].pk).update(status=GpuStatus.UNAVAILABLE)
    assert Gpu.transition_rows(node.gpus.all(), GpuStatus.RENTED, action="rent") == 2
    # Released: only rented GPUs become free; an unavailable one stays out.
    Gpu.objects.filter(pk=gpus[1].pk).update(status=GpuStatus.UNAVAILABLE)
    assert Gpu.transition_rows(node.gpus.all(), GpuStatus.FREE, action="release") == 1
    assert [g.status for g in node.gpus.order_by("index")] == ["free", "unavailable", "unavailable"]


@pytest.mark.django_db
def test_a_form_may_change_a_state_only_along_the_table(user):
    instance = book(user, make_listed_node(gpu_count=1))
    gpu = instance.allocations.get().gpu
    gpu.refresh_from_db()
    gpu.status = GpuStatus.UNAVAILABLE  # an operator takes out a GPU an instance holds: not while it holds it
    with pytest.raises(ValidationError, match=f"Instance {instance.pk} \\(requested\\) holds this GPU"):
        gpu.full_clean()
    svc.instance_mark_failed(instance_id=instance.pk, message="gone")
    gpu.refresh_from_db()
    gpu.status = GpuStatus.UNAVAILABLE  # released: allowed
    gpu.full_clean()
    gpu.save()
    gpu.status = GpuStatus.RENTED  # back to rented by hand: not a move of the table
    with pytest.raises(ValidationError, match="cannot go from unavailable to rented"):
        gpu.full_clean()


# -------------------------------------------------------------------------------------------------- the pages

@pytest.mark.django_db
@pytest.mark.parametrize("status", list(InstanceStatus))
def test_the_instance_page_shows_the_buttons_the_table_allows(status):
    renter = UserFactory()
    instance = book(renter, make_listed_node(gpu_count=1))
    Instance.objects.filter(pk=instance.pk).update(status=status)
    page = logged_in(renter).get(f"/instances/{instance.pk}/live/").content.decode()
    shown = {verb for verb in VERBS if f'action="/instances/{instance.pk}/{verb}/"' in page}
    assert shown == {verb for verb in VERBS if status in INSTANCE_TRANSITIONS.action_sources(verb)}


@pytest.mark.django_db
@pytest.mark.parametrize("state", list(NodeState))
def test_the_node_page_offers_verify_and_retire_as_the_table_allows(state):
    node = make_node(state=state)
    page = logged_in(node.provider).get(f"/nodes/{node.pk}/").content.decode()
    assert (f'action="/nodes/{node.pk}/verify/"' in page) == node.verify_allowed()
    assert (f'action="/nodes/{node.pk}/retire/"' in page) == (state != NodeState.RETIRED)


@pytest.mark.django_db
def test_the_migration_brings_older_rows_in_line_before_adding_the_rules(user):
    """provisioning 0004 on a database written before it: a finished job without finished_at, two open jobs of one
    kind for an instance, two open verifications of a node. Done inside the test's transaction (PostgreSQL DDL
    is transactional): the constraints are dropped, the rows written, the repair run, the constraints added."""
    migration = importlib.import_module("provisioning.migrations.0004_declared_states_one_open_job")
    rules = [c for c in Job._meta.constraints if c.name.startswith("job_")]
    with connection.schema_editor() as editor:
        for rule in rules:
            editor.remove_constraint(Job, rule)
    instance = book(user, make_listed_node(gpu_count=1))
    newer = Job.objects.create(kind=JobKind.INSTANCE_PROVISION, node=instance.node, instance=instance,
                               status=JobStatus.RUNNING, deadline=timezone.now())
    older = Job.objects.get(instance=instance, status=JobStatus.QUEUED)
    verifies = [Job.objects.create(kind=JobKind.NODE_VERIFY, node=instance.node, deadline=timezone.now())
                for _ in range(2)]
    done = Job.objects.create(kind=JobKind.NODE_VERIFY, node=instance.node, status=JobStatus.SUCCEEDED,
                              deadline=timezone.now())
    migration.repair(apps, None)
    with connection.cursor() as cursor:
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
    with connection.schema_editor() as editor:
        for rule in rules:
            editor.add_constraint(Job, rule)  # raises if a row still breaks one
    assert Job.objects.get(pk=newer.pk).status == "running" and Job.objects.get(pk=older.pk).status == "failed"
    assert [Job.objects.get(pk=j.pk).status for j in verifies] == ["failed", "queued"]
    assert Job.objects.get(pk=done.pk).finished_at == done.created_at
