"""A signed-in user sent to the log-in page with `next` pointing at it (found by review) got a 500: Django's
redirect_authenticated_user refuses to redirect to the page it is on. The log-in page's own address as `next` now
counts as none: LOGIN_REDIRECT_URL, signed in already or after the log-in."""
import pytest
from django.test import Client
from django.urls import reverse

from tests.web.conftest import PASSWORD

pytestmark = pytest.mark.django_db


def test_a_signed_in_user_sent_to_the_login_page_with_next_pointing_at_it_is_not_a_500(web):
    response = web.get("/accounts/login/?next=/accounts/login/")
    assert response.status_code in (200, 302)


@pytest.mark.parametrize("next_url", ["/accounts/login/", "/accounts/login/?next=/accounts/login/",
                                      "/accounts/%6Cogin/", "http://testserver/accounts/login/"])
def test_the_login_page_as_next_sends_a_signed_in_user_home(web, next_url):
    response = web.get("/accounts/login/", {"next": next_url})
    assert response.status_code == 302 and response["Location"] == reverse("home")


def test_another_next_is_still_followed(web):
    response = web.get("/accounts/login/", {"next": "/account/security/"})
    assert response.status_code == 302 and response["Location"] == "/account/security/"


def test_a_log_in_with_the_login_page_as_next_lands_home(renter):
    renter.set_password(PASSWORD)
    renter.save()
    response = Client().post("/accounts/login/?next=/accounts/login/", {"username": renter.email,
                                                                         "password": PASSWORD})
    assert response.status_code == 302 and response["Location"] == reverse("home")


@pytest.mark.parametrize("staff", [False, True])
def test_the_admin_login_with_itself_as_next_is_not_a_500(renter, staff):
    """The admin's log-in does not redirect a signed-in user by `next` (Django's AdminSite.login: staff go to the
    index, others get the form)."""
    renter.is_staff = staff
    renter.save()
    client = Client()
    client.force_login(renter)
    response = client.get("/admin/login/?next=/admin/login/")
    assert response.status_code == (302 if staff else 200)
