"""An id searched in the admin lists is compared as a number, which the column's index answers (core/admin_search.py).

Django searched "=instance__id" as UPPER("instance_id"::text) = UPPER('5'): exact, but no index serves the text of
an integer column, so every search of the usage intervals (a row per instance per meter run) read the whole table.
Now `"instance_id" = 5`; a term that is no number searches the text fields only, and the text fields still see a
number where the admin says so (a job's "7000" finds job 7000 and the jobs of node "gpu7000").
"""
import uuid
from datetime import timedelta

import pytest
from django.contrib import admin
from django.db import connection
from django.db.models import Q
from django.test import RequestFactory
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from billing.models import UsageInterval
from core.admin_search import KeySearchAdmin, key_field
from marketplace.models import Instance, Interruption
from notifications.models import WebhookDelivery
from provisioning.models import Job
from tests.factories import UserFactory, make_listed_node, make_node
from tests.marketplace.renting_helpers import book
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db

EVENT = uuid.UUID("0b7e5c1e-7a51-4d36-9c1f-2f6a3c9d8e10")


def _search(model, term):
    model_admin = admin.site._registry[model]
    request = RequestFactory().get("/", {"q": term})
    found, duplicates = model_admin.get_search_results(request, model.objects.all(), term)
    pks = list(found.values_list("pk", flat=True))
    assert len(pks) == len(set(pks)), "a row listed twice"
    return set(pks), duplicates


def test_every_admin_searching_a_key_column_compares_it_as_a_value():
    """Whichever list searches an integer or UUID column (an id, a foreign key's id) does it by KeySearchAdmin;
    the GPUs' "uuid" (nvidia-smi's text in a CharField) stays a text search."""
    found = set()
    for model, model_admin in admin.site._registry.items():
        for name in model_admin.search_fields:
            if key_field(model, str(name)):
                found.add((model.__name__, name))
                assert isinstance(model_admin, KeySearchAdmin), (model, name)
    assert {("UsageInterval", "=instance__id"), ("Job", "=id"), ("Instance", "=id"),
            ("Interruption", "=instance__id"), ("WebhookDelivery", "=event_id")} <= found
    assert not any(name.endswith("uuid") for _, name in found)
    assert key_field(Instance, "id") and key_field(Instance, "pk") and key_field(Interruption, "instance")
    assert key_field(Interruption, "instance__id__exact") and not key_field(Instance, "^id")


@pytest.mark.parametrize(("changelist", "model", "column", "term", "compared"), [
    ("billing/usageinterval", UsageInterval, "instance_id", "5", " = 5"),
    ("provisioning/job", Job, "id", "5", " = 5"),
    ("marketplace/instance", Instance, "id", "5", " = 5"),
    ("marketplace/interruption", Interruption, "instance_id", "5", " = 5"),
    ("notifications/webhookdelivery", WebhookDelivery, "event_id", str(EVENT), f" = '{EVENT.hex}'::uuid"),
])
def test_the_list_compares_the_key_column_with_the_value_never_its_text(changelist, model, column, term, compared):
    op = UserFactory(is_staff=True, is_superuser=True)
    with CaptureQueriesContext(connection) as queries:
        assert logged_in(op).get(f"/admin/{changelist}/", {"q": term}).status_code == 200
    table = model._meta.db_table
    sql = [q["sql"] for q in queries.captured_queries if f'FROM "{table}"' in q["sql"]]
    assert sql
    qualified = f'"{table}"."{column}"'
    assert any(qualified + compared in s for s in sql), sql
    assert not any(f"{qualified}::text" in s for s in sql), sql


def _booked_as(pk, renter):
    """An instance booked through the service, given the id `pk` by its sequence."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT setval(pg_get_serial_sequence(%s, 'id'), %s)", [Instance._meta.db_table, pk - 1])
    instance = book(renter, make_listed_node(gpu_count=1))
    assert instance.pk == pk
    return instance


@pytest.fixture
def intervals():
    """An interval of each of instances 7000, 17000 and 70000, and of a fourth whose renter's e-mail holds "7000"."""
    instances = [_booked_as(pk, UserFactory()) for pk in (7000, 17000, 70000)]
    real = book(UserFactory(email="renter7000@example.com"), make_listed_node(gpu_count=1))
    start = timezone.now() - timedelta(hours=1)
    rows = {}
    for instance in (*instances, real):
        rows[instance.pk] = UsageInterval.objects.create(
            instance=instance, started_at=start, ended_at=start + timedelta(minutes=30), seconds=1800,
            price_per_hour_micros=1_000_000, platform_fee_bps=1000, amount_micros=500_000, fee_micros=50_000).pk
    return rows, real


def test_a_number_finds_that_instance_s_intervals_only(intervals):
    rows, real = intervals
    assert _search(UsageInterval, "7000") == ({rows[7000]}, False)  # not 17000, 70000, nor the renter7000's
    assert _search(UsageInterval, f"{real.pk}") == ({rows[real.pk]}, False)
    assert _search(UsageInterval, "renter7000") == ({rows[real.pk]}, False)  # no number: the e-mail
    assert _search(UsageInterval, "7000 renter7000") == (set(), False)  # every term must match
    assert _search(UsageInterval, f"{real.pk} renter7000")[0] == {rows[real.pk]}
    assert _search(UsageInterval, "99999999999")[0] == set()  # past the column's range: no error, no row
    assert _search(UsageInterval, "٧٠٠٠")[0] == set()  # not ASCII digits: no id (nor an e-mail here)


def test_a_job_number_finds_that_job_and_still_the_text_fields():
    """JobAdmin does not set key_terms_search_keys_only: a number is the job's id or a node name's part."""
    other = make_node(name="plain")
    gpu7000 = make_node(name="gpu7000")
    now = timezone.now()
    for pk in (7000, 17000, 70000):
        Job.objects.create(id=pk, kind="node_verify", node=other, status="succeeded", finished_at=now, deadline=now)
    on_gpu7000 = Job.objects.create(kind="instance_provision", node=gpu7000, status="succeeded", finished_at=now,
                                    deadline=now)
    expected = set(Job.objects.filter(Q(pk=7000) | Q(node=gpu7000)).values_list("pk", flat=True))
    assert on_gpu7000.pk in expected and 17000 not in expected
    assert _search(Job, "7000") == (expected, False)
    assert _search(Job, '"7000"') == (expected, False)  # quoted as Django reads it
    assert _search(Job, "gpu7000")[0] == set(Job.objects.filter(node=gpu7000).values_list("pk", flat=True))
    assert 7000 not in _search(Job, "7000 gpu")[0]  # job 7000's node is "plain"


def test_a_uuid_searches_the_event_ids_only_and_anything_else_the_text():
    assert _search(WebhookDelivery, str(EVENT)) == (set(), False)
    model_admin = admin.site._registry[WebhookDelivery]
    request = RequestFactory().get("/")
    found, _ = model_admin.get_search_results(request, WebhookDelivery.objects.all(), "hooks.example")
    where = str(found.query).split(" WHERE ")[1]
    assert "event_id" not in where and "LIKE" in where
    found, _ = model_admin.get_search_results(request, WebhookDelivery.objects.all(), EVENT.hex)  # no hyphens
    where = str(found.query).split(" WHERE ")[1]
    assert f'"event_id" = {EVENT}' in where and "LIKE" not in where


def test_a_term_no_field_can_match_finds_nothing():
    """An admin whose only search field is an id: "abc" matches no row (an empty OR is no filter at all)."""

    class IdOnly(KeySearchAdmin):
        search_fields = ["=id"]

    model_admin = IdOnly(Job, admin.site)
    now = timezone.now()
    Job.objects.create(kind="node_verify", node=make_node(name="n"), status="succeeded", finished_at=now, deadline=now)
    request = RequestFactory().get("/")
    assert Job.objects.exists()
    found, _ = model_admin.get_search_results(request, Job.objects.all(), "abc")
    assert not found.exists()


def test_the_usage_list_searched_by_instance_reads_the_instance_index():
    """EXPLAIN of what the list runs, over 20,000 intervals of 2,000 instances: the instance's rows found by the
    (instance, started_at) index, no scan of the table. Before, the id's text was a Filter on every row."""
    table = UsageInterval._meta.db_table
    with connection.cursor() as cursor:
        # Intervals of instances that are not there: the plan is the point, and booking 2,000 would take minutes.
        # The test's transaction is rolled back, the trigger with it.
        cursor.execute(f"ALTER TABLE {table} DISABLE TRIGGER billing_usageinterval_references")
        cursor.execute(f"""
            INSERT INTO {table} (instance_id, started_at, ended_at, seconds,
                price_per_hour_micros, platform_fee_bps, amount_micros, fee_micros, created_at)
            SELECT 100000 + g / 10, now() - g * interval '1 minute', now() - g * interval '1 minute' + interval '30 s',
                30, 1000000, 1000, 8333, 833, now()
            FROM generate_series(0, 19999) AS g""")  # noqa: S608 (a model's table)
        cursor.execute(f"ALTER TABLE {table} ENABLE TRIGGER billing_usageinterval_references")
        cursor.execute(f"ANALYZE {table}")
    op = UserFactory(is_staff=True, is_superuser=True)
    with CaptureQueriesContext(connection) as queries:
        assert logged_in(op).get("/admin/billing/usageinterval/", {"q": "100500"}).status_code == 200
    sql = [q["sql"] for q in queries.captured_queries if f'FROM "{table}"' in q["sql"]]
    assert len(sql) >= 2  # the page's rows and its count
    with connection.cursor() as cursor:
        for statement in sql:
            cursor.execute("EXPLAIN " + statement)
            plan = "\n".join(row[0] for row in cursor.fetchall())
            assert f"Seq Scan on {table}" not in plan, plan
            assert "Index Cond: (instance_id = 100500)" in plan, plan
