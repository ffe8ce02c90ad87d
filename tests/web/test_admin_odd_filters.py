"""A list of the operators' panel filtered by a hand-written query string is never a 500 (found by review:
?created_at__year=99999 was one on about twenty lists, a ValueError when the SQL was compiled). The same held for
every lookup whose value fails only when the query is compiled or run: iso_year and date__year past 9999, a year
beyond a C long, an invalid regular expression (a DataError), range with other than two values, contained_by on a
plain column, text for a binary column. Each is now Django's answer to an invalid lookup: the list again,
unfiltered, with ?e=1 (core/admin_site.py)."""
import pytest
from django.contrib import admin
from django.db import models

from marketplace.models import Instance, Interruption
from provisioning.models import NodeEvent
from tests.factories import make_listed_node
from tests.marketplace.renting_helpers import book
from tests.web.conftest import fund, logged_in

pytestmark = pytest.mark.django_db


def _first(model, *kinds) -> str | None:
    return next((f.name for f in model._meta.concrete_fields if isinstance(f, kinds)), None)


def _odd_filters(model) -> list[str]:
    pk = model._meta.pk.name
    odd = [f"{pk}__regex=(", f"{pk}__range=99999", f"{pk}__range=(", f"{pk}__contained_by=1", f"{pk}__iregex=["]
    date = _first(model, models.DateTimeField, models.DateField)
    if date:
        odd += [f"{date}__year=99999", f"{date}__year=0", f"{date}__year=-1", f"{date}__year={'9' * 30}",
                f"{date}__year__gte=99999", f"{date}__iso_year=99999", f"{date}__iso_year__lt=-1",
                f"{date}__date__year=99999", f"{date}__regex=("]
    text = _first(model, models.CharField, models.TextField)
    if text:
        odd += [f"{text}__regex=(", f"{text}__iregex=[", f"{text}__range=x"]
    binary = _first(model, models.BinaryField)
    if binary:
        odd += [f"{binary}=abc", f"{binary}__gt=abc"]
    hierarchy = admin.site._registry[model].date_hierarchy
    if hierarchy:
        odd += [f"{hierarchy}__year={'9' * 30}", f"{hierarchy}__year=99999", f"{hierarchy}__year=2024&"
                f"{hierarchy}__month={'9' * 30}", f"{hierarchy}__year=2024&{hierarchy}__month=1&{hierarchy}__day=-1"]
    return odd


def test_no_hand_written_filter_is_a_500_on_any_list(operator):
    client = logged_in(operator)
    bad = []
    for model in admin.site._registry:
        url = f"/admin/{model._meta.app_label}/{model._meta.model_name}/"
        for query in _odd_filters(model):
            try:
                response = client.get(f"{url}?{query}")
                answer = (response.status_code, response.get("Location"))
            except Exception as exc:  # noqa: BLE001  the test client raises a view's exception
                answer = (repr(exc)[:120], None)
            # Django's invalid-lookup answer, or its 400 for a lookup the admin forbids (a user's password).
            if answer != (302, f"{url}?e=1") and answer[0] != 400:
                bad.append((url, query, answer))
    assert not bad, bad


def test_the_lists_own_filters_and_links_still_filter(operator, renter, stranger):
    """The list filters, the date hierarchy, and core/admin_history.py's links (`?<fk>__id__exact=<pk>`) pass."""
    fund(renter)
    node = make_listed_node(stranger, name="n1", gpu_count=2)
    instance = book(renter, node)
    NodeEvent.objects.create(node=node, kind="offline", message="flap")
    client = logged_in(operator)
    year = instance.created_at.year
    for url, shown in ((f"/admin/provisioning/nodeevent/?node__id__exact={node.pk}", "flap"),
                       (f"/admin/marketplace/instance/?created_at__year={year}", f"/{instance.pk}/change/"),
                       (f"/admin/marketplace/instance/?created_at__year={year}&created_at__month=2&created_at__day=30",
                        None),
                       ("/admin/marketplace/gpu/?status__exact=rented", None),
                       ("/admin/marketplace/apikey/?revoked_at__isempty=1", None),
                       (f"/admin/marketplace/interruption/?instance__id__exact={instance.pk}", None)):
        response = client.get(url)
        if shown is None:
            assert response.status_code in (200, 302), url
            continue
        assert response.status_code == 200, (url, response.status_code)
        assert shown in response.content.decode(), url
    empty = client.get(f"/admin/provisioning/nodeevent/?node__id__exact={node.pk + 1000}")
    assert empty.status_code == 200 and "flap" not in empty.content.decode()
    assert Interruption.objects.count() == 0 and Instance.objects.count() == 1


# Hand-written ranges whose bounds carry an offset that moves them past datetime's years once read in UTC
# (0001-01-01 00:00+05:00 is in year 0; 9998-12-31 23:00-05:00 is 9999, whose next year no period has): the
# instances' and interruptions' date drill-down judged the year before reading the bound in UTC, a 500 once the
# table had a row (found by review). Any list's own date filter, or the range as a plain lookup, answers them.
OFFSET_RANGES = [
    ("0001-01-01 00:00:00%2B05:00", "0001-01-02 00:00:00%2B05:00"),
    ("0001-01-01 00:00:00%2B14:00", "0001-01-01 12:00:00%2B14:00"),
    ("9998-12-31 23:00:00-05:00", "9999-01-01 23:00:00-05:00"),
    ("9999-12-31 23:00:00-05:00", "2000-01-01 00:00:00%2B00:00"),
    ("9999-12-31 12:00:00-14:00", "9999-12-31 13:00:00-14:00"),
    ("2024-01-01 00:00:00%2B05:00", "2025-01-01 00:00:00-05:00"),
]


def test_no_hand_written_range_with_an_offset_is_a_500_on_any_list(operator, renter, stranger):
    fund(renter)
    instance = book(renter, make_listed_node(stranger, gpu_count=1))  # rows: the drill-down reads the table's bounds
    Interruption.objects.create(instance=instance, cause="node_lost", detail="", started_at=instance.created_at,
                                detected_at=instance.created_at, ended_at=instance.created_at, outcome="resumed")
    client = logged_in(operator)
    bad = []
    for model in admin.site._registry:
        date = _first(model, models.DateTimeField, models.DateField)
        if not date:
            continue
        url = f"/admin/{model._meta.app_label}/{model._meta.model_name}/"
        for since, until in OFFSET_RANGES:
            query = f"{date}__gte={since}&{date}__lt={until}"
            try:
                response = client.get(f"{url}?{query}")
                answer = (response.status_code, response.get("Location"))
            except Exception as exc:  # noqa: BLE001  the test client raises a view's exception
                answer = (repr(exc)[:120], None)
            # The list filtered by the range, or Django's invalid-lookup answer (a date column given a time).
            if answer[0] != 200 and answer != (302, f"{url}?e=1"):
                bad.append((url, query, answer))
    assert not bad, bad
