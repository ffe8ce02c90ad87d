"""The instances' and interruptions' admin lists (KeySearchAdmin, core/admin_search.py): a number is compared with
the key as a value (`"marketplace_instance"."id" = 5`, never its ::text), and the text fields still answer both a
word and a number inside a name (a node "gpu<n>"), as tests/test_round47_admin_id_search.py checks for the jobs."""
import pytest
from django.contrib import admin
from django.test import RequestFactory
from django.utils import timezone

from marketplace.models import Instance, Interruption
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book

pytestmark = pytest.mark.django_db


def _search(model, term):
    model_admin = admin.site._registry[model]
    found, duplicates = model_admin.get_search_results(RequestFactory().get("/", {"q": term}), model.objects.all(),
                                                       term)
    assert not duplicates
    return set(found.values_list("pk", flat=True)), str(found.query)


@pytest.fixture
def booked():
    """Two instances: one of a renter "someone@..." on node "plain", one of "other@..." on a node whose name holds
    the first instance's id."""
    first = book(UserFactory(email="someone@example.com"), make_listed_node(gpu_count=1, name="plain"))
    second = book(UserFactory(email="other@example.com"), make_listed_node(gpu_count=1, name=f"gpu{first.pk}"))
    return first, second


def test_the_instances_list_compares_the_id_and_still_searches_the_text(booked):
    first, second = booked
    found, sql = _search(Instance, str(first.pk))
    assert found == {first.pk, second.pk}  # the id, and the node named after it
    assert f'"marketplace_instance"."id" = {first.pk}' in sql and '"id"::text' not in sql
    assert _search(Instance, "someone")[0] == {first.pk}  # the renter's e-mail
    assert _search(Instance, f"gpu{first.pk}")[0] == {second.pk}  # the node's name
    assert _search(Instance, "nobody")[0] == set()


def test_the_interruptions_list_compares_the_instance_id_and_still_searches_the_text(booked):
    first, second = booked
    now = timezone.now()
    rows = {i.pk: Interruption.objects.create(instance=i, cause="node_lost", started_at=now, detected_at=now).pk
            for i in (first, second)}
    found, sql = _search(Interruption, str(first.pk))
    assert found == {rows[first.pk], rows[second.pk]}  # its instance, and the one on the node named after it
    assert f'"marketplace_interruption"."instance_id" = {first.pk}' in sql and '"instance_id"::text' not in sql
    assert _search(Interruption, "someone")[0] == {rows[first.pk]}
    assert _search(Interruption, f"gpu{first.pk}")[0] == {rows[second.pk]}
