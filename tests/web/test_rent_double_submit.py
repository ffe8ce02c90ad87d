"""A rent form sent twice (a double click, a resent form) answers the instance its first sending booked, also where
that booking took the offer's last free GPU or slices: the page checked the offer's availability before the
booking service's replay and said "not available" (404) or "Select a valid choice" (400) while the instance
existed and was billed (found by review). The replay is the renter's own, for this offer only."""
import pytest
from django.contrib.messages import get_messages

from marketplace.models import Instance
from tests.factories import make_listed_node
from tests.marketplace.mig_helpers import SEVEN, make_mig_node
from tests.marketplace.renting_helpers import ed25519_key
from tests.web.conftest import fund, logged_in

pytestmark = pytest.mark.django_db


def _body(**extra):
    return {"image": "cuda-12-4", "num_gpus": "1", "ssh_public_key": ed25519_key(), "request_token": "same", **extra}


def test_double_submit_booking_the_last_gpu_answers_the_instance_not_404(web, funded_renter):
    node = make_listed_node(gpu_model="rtx-a6000", gpu_count=1)
    body = _body()
    first = web.post(f"/offers/{node.pk}/rent/", body)
    second = web.post(f"/offers/{node.pk}/rent/", body)  # the double click's second request
    assert first.status_code == 302
    instance = Instance.objects.get(renter=funded_renter)
    assert second.status_code == 302 and second["Location"] == first["Location"] == f"/instances/{instance.pk}/"
    assert [str(m) for m in get_messages(second.wsgi_request)] == [
        f"Instance {instance.pk} booked: the node is preparing it."]


def test_double_submit_booking_the_last_slices_of_a_profile_answers_the_instance(web, funded_renter):
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"], 1: SEVEN}, {"3g.40gb": "0.70", "1g.10gb": "0.25"})
    body = _body(num_gpus="2", mig_profile="3g.40gb")
    first = web.post(f"/offers/{node.pk}/rent/", body)
    second = web.post(f"/offers/{node.pk}/rent/", body)
    assert first.status_code == 302
    assert Instance.objects.filter(renter=funded_renter).count() == 1
    assert second.status_code == 302 and second["Location"] == first["Location"]


def test_another_renters_same_token_gets_no_one_elses_instance(web, funded_renter, stranger):
    node = make_listed_node(gpu_model="rtx-a6000", gpu_count=1)
    body = _body()
    assert web.post(f"/offers/{node.pk}/rent/", body).status_code == 302
    fund(stranger)
    theirs = logged_in(stranger)
    r = theirs.post(f"/offers/{node.pk}/rent/", body)  # the same token and body: the offer is taken, for them
    assert r.status_code == 404
    assert not Instance.objects.filter(renter=stranger).exists()
    other = make_listed_node(gpu_model="rtx-a6000", gpu_count=1)
    r = theirs.post(f"/offers/{other.pk}/rent/", body)  # a booking of their own
    mine = Instance.objects.get(renter=funded_renter)
    assert r.status_code == 302 and r["Location"] == f"/instances/{Instance.objects.get(renter=stranger).pk}/"
    assert r["Location"] != f"/instances/{mine.pk}/"


def test_the_same_token_for_another_offer_is_other_choices_not_a_replay(web, funded_renter):
    node = make_listed_node(gpu_model="rtx-a6000", gpu_count=1)
    other = make_listed_node(gpu_model="rtx-a6000", gpu_count=1)
    body = _body()
    first = web.post(f"/offers/{node.pk}/rent/", body)
    assert first.status_code == 302
    r = web.post(f"/offers/{other.pk}/rent/", body)
    assert r.status_code == 400 and "already used to book an instance with other choices" in r.content.decode()
    assert Instance.objects.filter(renter=funded_renter).count() == 1
    # the page's fresh token books the other offer
    token = r.context["form"]["request_token"].value()
    assert token and token != "same"
    r = web.post(f"/offers/{other.pk}/rent/", {**body, "request_token": token})
    assert r.status_code == 302 and r["Location"] != first["Location"]
    assert Instance.objects.filter(renter=funded_renter).count() == 2


def test_the_same_token_with_other_choices_on_a_free_offer_says_so(web, funded_renter):
    node = make_listed_node(gpu_model="rtx-a6000", gpu_count=2)
    assert web.post(f"/offers/{node.pk}/rent/", _body()).status_code == 302
    r = web.post(f"/offers/{node.pk}/rent/", _body(image="pytorch-2-5"))
    assert r.status_code == 400 and "already used to book an instance with other choices" in r.content.decode()
    assert Instance.objects.filter(renter=funded_renter).count() == 1


@pytest.mark.parametrize("token", ["t\x00", "t" * 97])
def test_a_token_the_form_refuses_is_no_replay_and_no_500(web, funded_renter, token):
    node = make_listed_node(gpu_model="rtx-a6000", gpu_count=1)
    web.raise_request_exception = False
    r = web.post(f"/offers/{node.pk}/rent/", _body(request_token=token))
    assert r.status_code == 400 and not Instance.objects.exists()
