"""/compat/vast/...: the paths the `vastai` CLI builds (`/api/v0` prefixed unless it names `/api/vN/`), each with
and without its trailing slash, and a JSON 404 for every other."""
from django.urls import path, re_path, register_converter

from . import views


class IdConverter:
    """An id a bigint column holds (at most 18 digits); anything longer is no route (the JSON 404)."""

    regex = "[0-9]{1,18}"

    def to_python(self, value: str) -> int:
        return int(value)

    def to_url(self, value: int) -> str:
        return str(value)


register_converter(IdConverter, "vast_id")


def _both(route: str, view):
    """The route as written and without its trailing slash (the CLI sends `machines?owner=me`, `users/current`)."""
    return [path(route, view), path(route.rstrip("/"), view)]


urlpatterns = [
    *_both("api/v0/bundles/", views.OffersSearchView.as_view()),
    *_both("api/v0/asks/<vast_id:ask_id>/", views.OfferCreateView.as_view()),
    *_both("api/v1/instances/", views.InstanceListView.as_view()),
    *_both("api/v0/instances/filters/", views.InstanceFiltersView.as_view()),
    *_both("api/v0/instances/<vast_id:instance_id>/", views.InstanceView.as_view()),
    *_both("api/v0/users/current/", views.CurrentUserView.as_view()),
    *_both("api/v0/ssh/", views.SshKeysView.as_view()),
    *_both("api/v0/ssh/<vast_id:key_id>/", views.SshKeyView.as_view()),
    *_both("api/v0/machines/", views.MachinesView.as_view()),
    *_both("api/v0/machines/create_asks/", views.MachineListView.as_view()),
    *_both("api/v0/machines/<vast_id:node_id>/", views.MachineView.as_view()),
    *_both("api/v0/machines/<vast_id:node_id>/asks/", views.MachineUnlistView.as_view()),
    re_path(r"", views.UnsupportedView.as_view()),
]
