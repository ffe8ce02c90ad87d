"""A catalogue image's page opened before another operator took the image off the catalogue (found by review): the
form wrote the whole row back as the page showed it, so a Save made for the description ticked `active` again and
the image was offered to renters. Every editable field of the image's and the group's pages now carries the page's
value; a field changed since is refused on the form when the posted value differs from the stored one, and the
save writes only the columns the operator changed."""
import pytest
from django.contrib.auth.models import Group
from django.db import connection
from django.test.utils import CaptureQueriesContext

from marketplace.models import Image
from tests.web.conftest import logged_in
from tests.web.test_admin_pages import change_form

pytestmark = pytest.mark.django_db


@pytest.fixture
def image(db):
    return Image.objects.create(name="Broken", slug="broken", docker_image="library/ubuntu:24.04", min_disk_gb=10)


def _url(image) -> str:
    return f"/admin/marketplace/image/{image.pk}/change/"


def test_a_stale_image_page_does_not_reactivate_an_image_taken_off_meanwhile(operator):
    ops = logged_in(operator)
    image = Image.objects.create(name="Broken", slug="broken", docker_image="library/ubuntu:24.04", min_disk_gb=10)
    url = f"/admin/marketplace/image/{image.pk}/change/"
    data = change_form(ops, url, "image_form")
    assert data.get("active") == ["on"]
    Image.objects.filter(pk=image.pk).update(active=False)
    data["description"] = ["Ubuntu 24.04"]
    r = ops.post(url, data)
    assert not Image.objects.get(pk=image.pk).active, f"re-listed (status {r.status_code})"
    assert r.status_code == 200 and "Changed by someone else since you opened this page: it is off now." in (
        r.content.decode())
    assert Image.objects.get(pk=image.pk).description == ""  # nothing of the page saved

    data = change_form(ops, url, "image_form")  # opened again: the description is saved, the image stays off
    data["description"] = ["Ubuntu 24.04"]
    assert ops.post(url, data).status_code == 302
    stored = Image.objects.get(pk=image.pk)
    assert not stored.active and stored.description == "Ubuntu 24.04"


def test_a_stale_image_page_does_not_write_back_a_container_image_changed_meanwhile(operator, image):
    ops = logged_in(operator)
    data = change_form(ops, _url(image), "image_form")
    Image.objects.filter(pk=image.pk).update(docker_image="library/ubuntu:24.10")
    data["min_disk_gb"] = ["30"]
    r = ops.post(_url(image), data)
    assert r.status_code == 200 and "it is “library/ubuntu:24.10” now" in r.content.decode()
    stored = Image.objects.get(pk=image.pk)
    assert (stored.docker_image, stored.min_disk_gb) == ("library/ubuntu:24.10", 10)


def test_a_save_writes_only_the_columns_the_operator_changed(operator, image):
    ops = logged_in(operator)
    data = change_form(ops, _url(image), "image_form")
    data["description"] = ["Ubuntu 24.04"]
    with CaptureQueriesContext(connection) as queries:
        assert ops.post(_url(image), data).status_code == 302
    updates = [q["sql"] for q in queries.captured_queries if q["sql"].startswith('UPDATE "marketplace_image"')]
    assert len(updates) == 1 and '"description"' in updates[0] and '"active"' not in updates[0]
    assert Image.objects.get(pk=image.pk).description == "Ubuntu 24.04"

    data = change_form(ops, _url(image), "image_form")  # a Save that changed nothing writes nothing
    with CaptureQueriesContext(connection) as queries:
        assert ops.post(_url(image), data).status_code == 302
    assert not [q for q in queries.captured_queries if q["sql"].startswith('UPDATE "marketplace_image"')]


def test_a_stale_page_that_agrees_with_the_change_made_meanwhile_is_saved(operator, image):
    ops = logged_in(operator)
    data = change_form(ops, _url(image), "image_form")
    Image.objects.filter(pk=image.pk).update(active=False)
    data.pop("active")  # this operator takes it off too
    data["description"] = ["Retired"]
    assert ops.post(_url(image), data).status_code == 302
    stored = Image.objects.get(pk=image.pk)
    assert not stored.active and stored.description == "Retired"


def test_an_operator_takes_an_image_off_and_puts_it_back(operator, image):
    ops = logged_in(operator)
    data = change_form(ops, _url(image), "image_form")
    data.pop("active")
    assert ops.post(_url(image), data).status_code == 302
    assert not Image.objects.get(pk=image.pk).active
    data = change_form(ops, _url(image), "image_form")
    data["active"] = ["on"]
    assert ops.post(_url(image), data).status_code == 302
    assert Image.objects.get(pk=image.pk).active


def test_a_stale_group_page_does_not_write_back_a_name_changed_meanwhile(operator):
    ops = logged_in(operator)
    group = Group.objects.create(name="finance")
    url = f"/admin/auth/group/{group.pk}/change/"
    data = change_form(ops, url, "group_form")
    Group.objects.filter(pk=group.pk).update(name="finance (read only)")
    data["permissions"] = []
    r = ops.post(url, data)
    assert r.status_code == 200 and "it is “finance (read only)” now" in r.content.decode()
    assert Group.objects.get(pk=group.pk).name == "finance (read only)"
