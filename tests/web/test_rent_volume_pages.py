"""The rent page attaches volumes (issue 12): the renter's volumes on that server are offered with a mount path
each; the booking's rules give the page the API's own messages, next to the field, with nothing booked."""
import pytest

from marketplace.models import Instance, VolumeMount
from marketplace.services import volumes as volume_svc
from tests.conftest import _client_for
from tests.factories import make_listed_node
from tests.marketplace.renting_helpers import book, ed25519_key

pytestmark = pytest.mark.django_db


def _volume(owner, node, size_gb=5, label=""):
    return volume_svc.volume_mark_available(
        volume_id=volume_svc.volume_create(owner=owner, node_id=node.pk, size_gb=size_gb, label=label).pk)


def _form(**extra):
    return {"image": "pytorch-2-5", "num_gpus": "1", "ssh_public_key": ed25519_key(), "request_token": "t", **extra}


@pytest.fixture
def node(db):
    return make_listed_node(gpu_model="rtx-a6000", gpu_count=4)


def test_the_rent_page_offers_only_ones_own_volumes_on_that_server(web, renter, stranger, node):
    mine = _volume(renter, node, label="datasets")
    elsewhere = _volume(renter, make_listed_node(gpu_model="rtx-a6000", gpu_count=2))
    theirs = _volume(stranger, node)
    gone = _volume(renter, node)
    volume_svc.volume_delete(volume=gone, confirm=gone.name)
    volume_svc.volume_mark_deleted(volume_id=gone.pk)
    page = web.get(f"/offers/{node.pk}/rent/").content.decode()
    assert '<details id="volumes-choice">' in page  # closed until a volume is ticked
    assert f'name="volumes" value="{mine.pk}"' in page and "datasets" in page
    assert f'name="mount_{mine.pk}"' in page and 'value="/data"' in page
    for other in (elsewhere, theirs, gone):
        assert other.name not in page and f'name="mount_{other.pk}"' not in page


def test_the_page_says_when_there_is_no_volume_on_that_server(web, node):
    page = web.get(f"/offers/{node.pk}/rent/").content.decode()
    assert "You have no volume on this server" in page and 'href="/volumes/"' in page


def test_rent_with_two_volumes_mounts_them_where_asked(web, funded_renter, node):
    first, second = _volume(funded_renter, node), _volume(funded_renter, node)
    r = web.post(f"/offers/{node.pk}/rent/", _form(volumes=[str(first.pk), str(second.pk)],
                                                    **{f"mount_{first.pk}": " /data ",
                                                       f"mount_{second.pk}": "/workspace/ckpt"}))
    assert r.status_code == 302, r.content.decode()[:3000]
    instance = Instance.objects.get(renter=funded_renter)
    mounts = {m.volume_id: m.mount for m in VolumeMount.objects.filter(instance=instance)}
    assert mounts == {first.pk: "/data", second.pk: "/workspace/ckpt"}
    # An unticked volume's mount path is ignored: nothing else was mounted.
    third = _volume(funded_renter, node)
    r = web.post(f"/offers/{node.pk}/rent/", _form(request_token="t2", **{f"mount_{third.pk}": "/x"}))
    assert r.status_code == 302 and not VolumeMount.objects.filter(volume=third).exists()


def _api_message(user, node, volumes) -> str:
    """What the API answers for the same `volumes`."""
    r = _client_for(user).post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "image": "pytorch-2-5",
                                                      "ssh_public_key": ed25519_key(), "volumes": volumes},
                               format="json")
    assert r.status_code == 400, r.content
    return r.json()["volumes"][0]


@pytest.mark.parametrize("case", ["relative mount", "bad mount", "same mount twice", "no mount",
                                  "another user's volume", "volume on another node", "unknown id"])
def test_bad_volumes_are_refused_next_to_the_field_with_the_apis_words_and_nothing_booked(
        web, funded_renter, stranger, node, case):
    first, second = _volume(funded_renter, node), _volume(funded_renter, node)
    form = {f"mount_{first.pk}": "/data", f"mount_{second.pk}": "/data2"}
    ticked = [first.pk]
    if case == "relative mount":
        form[f"mount_{first.pk}"] = "data"
    elif case == "bad mount":
        form[f"mount_{first.pk}"] = "/proc/x"
    elif case == "same mount twice":
        ticked, form[f"mount_{second.pk}"] = [first.pk, second.pk], "/data"
    elif case == "no mount":
        form[f"mount_{first.pk}"] = ""
    elif case == "another user's volume":
        ticked = [_volume(stranger, node).pk]
    elif case == "volume on another node":
        ticked = [_volume(funded_renter, make_listed_node(gpu_model="rtx-a6000", gpu_count=2)).pk]
    elif case == "unknown id":
        ticked = [999_999]
    for v in ticked:  # a posted form can name any id, with a mount path
        form.setdefault(f"mount_{v}", "/data")
    r = web.post(f"/offers/{node.pk}/rent/", _form(volumes=[str(v) for v in ticked], **form))
    page = r.content.decode()
    assert r.status_code == 400 and 'id="id_volumes_errors"' in page, page[:3000]
    assert '<details id="volumes-choice" open>' in page
    assert not Instance.objects.exists()
    if case == "no mount":  # the API's serializer refuses a missing mount before the booking does
        expected = "volumes[0].mount is an absolute path, e.g. /data."
    else:
        expected = _api_message(funded_renter, node, [{"volume": v, "mount": form.get(f"mount_{v}") or "/data"}
                                                      for v in ticked])
    assert expected and _html(expected) in page  # the API's own words
    assert not Instance.objects.exists()


def _html(text: str) -> str:
    return text.replace("&", "&amp;").replace("'", "&#x27;").replace('"', "&quot;").replace("<", "&lt;")


def test_a_volume_a_live_instance_mounts_is_refused_with_the_reason(web, funded_renter, node):
    volume = _volume(funded_renter, node)
    book(funded_renter, node, volumes=[{"volume": volume.pk, "mount": "/data"}])
    r = web.post(f"/offers/{node.pk}/rent/", _form(volumes=[str(volume.pk)], **{f"mount_{volume.pk}": "/data"}))
    assert r.status_code == 400 and "is mounted by instance" in r.content.decode()
    assert Instance.objects.count() == 1
