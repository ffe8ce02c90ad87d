"""Refuse requests whose URL no view can serve safely, before any of them runs: one place for the API, the pages
and the admin.

- A control character (Unicode category Cc: NUL and the other C0 characters, DEL, C1) in the path or in a query
  parameter's name or value is a 400. PostgreSQL refuses NUL in text, so a lookup such as
  `/api/v1/gpu-models/%00/` or a filter such as `/gpus/?models=%00` was a 500 (DataError); no identifier, slug or
  filter value of this platform has a control character, so none is lost. A middleware, not the lookup of each
  viewset or each filterset, because it is the one depth every route passes through: API viewsets and plain
  views, the pages, the admin, and whatever is added later.
- A session cookie with a control character is dropped (the request is anonymous, as with any unknown session):
  Django looks the session key up in the database.
- More query parameters than DATA_UPLOAD_MAX_NUMBER_FIELDS is a 400 (Django's own check, answered here).
- A body larger than DATA_UPLOAD_MAX_MEMORY_SIZE (by its Content-Length) is a 413, before anything reads it:
  Django applies that limit to form bodies only, and DRF's JSON parser would read any size.
- A URL longer than REQUEST_URL_MAX_CHARS is a 414. gunicorn answers longer request lines (over its
  --limit-request-line, scripts/run-web) with its own HTML page; below that limit the answer is ours.

Answers are JSON under /api/ (`{"detail": ...}`, as every API error) and a page elsewhere.
"""
import unicodedata
from collections.abc import Callable

from django.conf import settings
from django.core.exceptions import TooManyFieldsSent
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.http.response import HttpResponseBase
from django.shortcuts import render

CONTROL_CHARACTERS = "Control characters (such as NUL) are not allowed in a URL."
COMPAT_ERROR_CODES = {400: "bad_request", 413: "request_too_large", 414: "uri_too_long"}


def has_control_character(value: str) -> bool:
    # Fast path first: most URLs are printable ASCII.
    if value.isascii() and value.isprintable():
        return False
    return any(unicodedata.category(ch) == "Cc" for ch in value)


def _content_length(request: HttpRequest) -> int:
    try:
        return int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return 0  # not a number: Django's own parsing refuses it


class RequestGuardMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        if len(request.get_full_path()) > settings.REQUEST_URL_MAX_CHARS:
            return self._refuse(request, 414, "URI too long",
                                f"The URL is longer than {settings.REQUEST_URL_MAX_CHARS} characters.")
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        if limit is not None and _content_length(request) > limit:
            return self._refuse(request, 413, "Request too large",
                                f"The request body is larger than {limit} bytes.")
        try:
            query = request.GET.lists()
        except TooManyFieldsSent:
            return self._refuse(request, 400, "Bad request", f"More than {settings.DATA_UPLOAD_MAX_NUMBER_FIELDS} "
                                                             "query parameters.")
        if has_control_character(request.path_info) or any(
            has_control_character(name) or any(has_control_character(value) for value in values)
            for name, values in query
        ):
            return self._refuse(request, 400, "Bad request", CONTROL_CHARACTERS)
        session = request.COOKIES.get(settings.SESSION_COOKIE_NAME)
        if session is not None and has_control_character(session):
            del request.COOKIES[settings.SESSION_COOKIE_NAME]
        return self.get_response(request)

    @staticmethod
    def _refuse(request: HttpRequest, status: int, title: str, message: str) -> HttpResponse:
        if request.path_info.startswith("/api/"):
            return JsonResponse({"detail": message}, status=status)
        if request.path_info.startswith("/compat/"):  # other marketplaces' clients (the `vastai` CLI) read `msg`
            # The shape of every other compat error (docs/vast-cli.md), its code included.
            return JsonResponse({"success": False, "error": COMPAT_ERROR_CODES[status], "msg": message}, status=status)
        return render(request, "400.html", {"title": title, "message": message}, status=status)
