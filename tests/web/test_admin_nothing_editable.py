"""Pages of the operators' panel with no editable field of their model (their changes are actions that call the
services): their Save writes nothing (found by review, the node's page first). Django's save wrote the whole row back
as the page had read it, over what changed meanwhile: an instance's status moved by its worker, an API key revoked by
its owner (un-revoked), a MIG slice booked (free again)."""
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from marketplace.models import ApiKey, Instance, Interruption, MigSlice, Node, SshKey
from marketplace.services.accounts import api_key_create
from tests.factories import make_listed_node
from tests.marketplace.mig_helpers import make_mig_node
from tests.marketplace.renting_helpers import add_key, book
from tests.web.conftest import logged_in
from tests.web.test_admin_pages import change_form

pytestmark = pytest.mark.django_db


def _instance(renter):
    return book(renter, make_listed_node(gpu_count=1))


def _interruption(renter):
    now = timezone.now()
    return Interruption.objects.create(instance=_instance(renter), cause="node_lost", started_at=now,
                                       detected_at=now)


def _api_key(renter):
    key, _ = api_key_create(user=renter, name="laptop")
    return key


def _mig_slice(renter):
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, gpu_count=1)
    return MigSlice.objects.filter(node=node).first()


PAGES = {
    "instance": (Instance, _instance),
    "interruption": (Interruption, _interruption),
    "apikey": (ApiKey, _api_key),
    "sshkey": (SshKey, add_key),
    "migslice": (MigSlice, _mig_slice),
    "node": (Node, lambda renter: make_listed_node(gpu_count=1)),
}


@pytest.mark.parametrize("page", sorted(PAGES))
def test_saving_a_page_with_nothing_editable_writes_nothing(operator, renter, page):
    model, make = PAGES[page]
    obj = make(renter)
    assert obj is not None
    ops = logged_in(operator)
    url = f"/admin/marketplace/{page}/{obj.pk}/change/"
    data = change_form(ops, url, f"{page}_form")
    with CaptureQueriesContext(connection) as queries:
        r = ops.post(url, data)
    assert r.status_code == 302, r.content.decode()[:2000]
    table = f'"{model._meta.db_table}"'
    assert [q["sql"] for q in queries.captured_queries if q["sql"].startswith(f"UPDATE {table}")] == []
