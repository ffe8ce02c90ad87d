"""The admin's lists of notifications and webhook deliveries, the platform's longest logs after the ledger (found by
review: 1.7 s a page at a million notifications, two COUNT(*) and a sort of the whole table by -created_at, -id,
which no index serves; 1.1 s for the deliveries). They read newest first by the primary key, and count neither the
whole table (an estimate when unfiltered and large) nor twice. No timing here: what the queries are."""
from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from core.admin_paginator import EstimatedCountPaginator
from notifications.models import Kind, Notification, WebhookDelivery
from notifications.services import webhooks
from notifications.services.notify import notify
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

LISTS = [(Notification, "/admin/notifications/notification/"),
         (WebhookDelivery, "/admin/notifications/webhookdelivery/")]


@pytest.fixture
def ops(db):
    client = Client()
    client.force_login(UserFactory(email="ops@example.com", is_staff=True, is_superuser=True))
    return client


@pytest.fixture
def rows(owner, receiver, queued):
    """Three notifications, each with a delivery, created in the reverse order of their ids' (an import, a clock
    set back): the list's order is the id's."""
    webhooks.endpoint_create(user=owner, url=receiver.url)
    made = [notify(user=owner, kind=Kind.LOW_BALANCE, payload={}, dedupe_key=f"admin-{n}") for n in range(3)]
    for n, notification in enumerate(made):
        at = timezone.now() - timedelta(hours=n)
        Notification.objects.filter(pk=notification.pk).update(created_at=at)
        WebhookDelivery.objects.filter(notification=notification).update(created_at=at)
    return made


def _table(model) -> str:
    return f'"{model._meta.db_table}"'


def _counts(queries, model) -> list[str]:
    return [q["sql"] for q in queries.captured_queries
            if q["sql"].lstrip().upper().startswith("SELECT COUNT(") and f"FROM {_table(model)}" in q["sql"]]


def _analysed(model) -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {_table(model)}")  # noqa: S608 (a model's table)


@pytest.mark.parametrize(("model", "path"), LISTS)
def test_a_list_sorts_by_id_and_counts_once(ops, rows, model, path):
    with CaptureQueriesContext(connection) as queries:
        page = ops.get(path)
    assert page.status_code == 200
    selects = [q["sql"] for q in queries.captured_queries if q["sql"].startswith(f"SELECT {_table(model)}.")
               and " ORDER BY " in q["sql"]]
    assert len(selects) == 1, selects
    assert selects[0].split(" ORDER BY ")[1].startswith(f'{_table(model)}."id" DESC')
    assert len(_counts(queries, model)) == 1, "one count (the paginator's), no second 'N total' count"
    html = page.content.decode()
    shown = list(model.objects.order_by("-id").values_list("pk", flat=True))
    assert len(shown) == 3
    places = [html.index(f"{path}{pk}/change/") for pk in shown]
    assert places == sorted(places)  # newest (highest id) first, whatever created_at says


@pytest.mark.parametrize(("model", "path"), LISTS)
def test_a_large_unfiltered_list_is_counted_by_the_estimate(ops, rows, model, path, monkeypatch):
    monkeypatch.setattr(EstimatedCountPaginator, "estimate_above", 1)
    _analysed(model)
    with CaptureQueriesContext(connection) as queries:
        page = ops.get(path)
    assert page.status_code == 200
    assert _counts(queries, model) == [], "no COUNT(*) over the whole table"
    assert f"3 {model._meta.verbose_name_plural}" in page.content.decode()
    with CaptureQueriesContext(connection) as queries:  # filtered: counted exactly, by what the filter keeps
        page = ops.get(path, {"kind__exact": Kind.LOW_BALANCE})
    assert page.status_code == 200
    counts = _counts(queries, model)
    assert len(counts) == 1 and " WHERE " in counts[0]
