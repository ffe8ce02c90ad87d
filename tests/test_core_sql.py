"""core/sql.py: the booking's statements are prepared per connection (and not with DATABASE_PREPARED_STATEMENTS off),
still seen by Django's query log; ModelInsert writes the very row Model.save() writes."""
from datetime import timedelta

import pytest
from django.db import connection
from django.forms.models import model_to_dict
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from billing.services.ledger import credit_grant
from core.sql import ModelInsert, _numbered, prepared_cursor
from marketplace.models import Image, Instance
from marketplace.services.instances.options import InstanceOptions
from marketplace.services.instances.secrets import env_encrypt
from provisioning.models import Job, JobKind
from provisioning.services.jobs import JOB_DEADLINES, job_create
from tests.factories import make_listed_node
from tests.marketplace.renting_helpers import book


def _prepared() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0] for row in cursor.fetchall()]


@pytest.mark.django_db(transaction=True)
def test_a_bookings_statements_are_prepared_once_per_connection_and_still_logged(user, settings):
    settings.BILLING_REQUIRE_FUNDS = True  # the wallet's lock and the burn rate too
    credit_grant(user=user, amount_micros=100_000_000, reason="test")
    connection.close()  # a connection of its own: nothing prepared yet
    node = make_listed_node(gpu_count=4)
    with CaptureQueriesContext(connection) as first:
        book(user, node)
    book(user, node)
    prepared = _prepared()
    starts = ("WITH node_row AS (SELECT n.id", "WITH rate AS (SELECT COALESCE(SUM(i.price_per_hour_micros) FILTER")
    for start in starts:
        assert sum(s.startswith(start) for s in prepared) == 1, (start, prepared)  # once, however many bookings
    assert any("FOR SHARE OF n" in q["sql"] for q in first.captured_queries)  # the query log still sees them


@pytest.mark.django_db(transaction=True)
def test_with_prepared_statements_off_nothing_is_prepared(user, settings):
    settings.DATABASE_PREPARED_STATEMENTS = False
    connection.close()
    node = make_listed_node(gpu_count=2)
    book(user, node)
    book(user, node)
    assert _prepared() == []


def test_model_insert_writes_the_row_save_writes(db, user):
    node = make_listed_node(gpu_count=2)
    now = timezone.now()
    options = InstanceOptions(env={"TOKEN": "s3cret"}, ports=["8888/tcp"], onstart="echo hi",
                              min_cuda_version="12.2", registry_auth=None)

    def instance() -> Instance:
        return Instance(renter=user, node=node, gpu_model_id=node.gpu_model_id, num_gpus=1, label="n°1 ✓",
                        image=Image.objects.get(slug="cuda-12-4"), env_names=list(options.env),
                        env_encrypted=env_encrypt(options.env), onstart=options.onstart,
                        ports_requested=options.ports, min_cuda_version=options.min_cuda_version, disk_gb=30,
                        ssh_public_keys=["ssh-ed25519 AAAA key"], price_per_gpu_hour_micros=1_500_000,
                        price_per_hour_micros=1_500_000, platform_fee_bps=1500, created_at=now)

    saved = instance()
    saved.save(force_insert=True)
    inserted = instance()
    with prepared_cursor() as cursor:
        ModelInsert(Instance).insert(cursor, inserted)
    assert inserted.pk and inserted.pk != saved.pk and not inserted._state.adding

    def stored(pk: int) -> dict:
        row = model_to_dict(Instance.objects.get(pk=pk), exclude=["id"])
        row["updated_at"] = row["env_encrypted"] = None  # auto_now, and a Fernet token differs every time
        return row

    assert stored(inserted.pk) == stored(saved.pk)
    assert bytes(Instance.objects.get(pk=inserted.pk).env_encrypted).startswith(b"gAAAA")

    job_fields = {"kind": JobKind.INSTANCE_PROVISION, "node": node, "instance": saved, "step": "queued",
                  "deadline": now + timedelta(minutes=15), "created_at": now}
    Job(**job_fields).save(force_insert=True)
    job = Job(**{**job_fields, "instance": inserted})
    with prepared_cursor() as cursor:
        ModelInsert(Job).insert(cursor, job)
    a, b = (model_to_dict(j, exclude=["id", "instance"]) for j in Job.objects.filter(node=node).order_by("id"))
    assert a == b and a["log"] == [] and a["status"] == "queued"


def test_a_job_written_in_its_instances_statement_is_the_row_job_create_writes(db, user):
    """A booking's job goes in with its instance, in one statement (ModelInsert.sql_with): the same row."""
    node = make_listed_node(gpu_count=2)
    first, second = book(user, node), book(user, node)  # the booking's own statement wrote the second's job
    created = job_create(kind=JobKind.INSTANCE_START, node=node, instance=first)
    booked = Job.objects.get(instance=second)
    exclude = ["id", "instance", "kind", "deadline", "created_at"]
    assert model_to_dict(booked, exclude=exclude) == model_to_dict(created, exclude=exclude)
    deadline = timedelta(seconds=JOB_DEADLINES[JobKind.INSTANCE_PROVISION])
    assert abs(booked.deadline - booked.created_at - deadline) < timedelta(seconds=1)
    with pytest.raises(ValueError, match="Job has no column instance"):
        ModelInsert(Job).sql_with(instance="(SELECT 1)")


def test_placeholders_are_numbered_once_per_statement_text():
    numbered = _numbered("SELECT %s, '100%%', %s FROM t WHERE a = ANY(%s)")
    assert numbered == "SELECT $1, '100%', $2 FROM t WHERE a = ANY($3)"
    with pytest.raises(ValueError, match="not %\\("):
        _numbered("SELECT %(name)s")


def test_a_long_statement_with_many_parameters_runs_prepared(db):
    """Over psycopg's 4 KiB and 50 parameters (a booking's statement is both): numbered here, prepared once."""
    values = list(range(80))
    sql = "SELECT " + ", ".join(f"%s::int AS column_with_a_long_name_{i:03}" for i in values) + " -- " + "x" * 4096
    with prepared_cursor() as cursor:
        cursor.execute(sql, values)
        assert list(cursor.fetchone()) == values
        cursor.execute(sql, [v + 1 for v in values])
        assert list(cursor.fetchone()) == [v + 1 for v in values]
    assert sum("column_with_a_long_name_079" in s for s in _prepared()) == 1
