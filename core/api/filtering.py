"""django-filter for the API: a filter given without a value is a 400, not silently ignored, and so is a query
parameter that a list (or the detail of one object) does not read, and a filter of one value given twice."""
from collections.abc import Iterable
from typing import Any

import django_filters
from django import forms
from django.db.models import QuerySet
from django.http import HttpRequest, QueryDict
from django_filters.rest_framework import DjangoFilterBackend
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.settings import api_settings
from rest_framework.views import APIView

PAGINATION_PARAMS = {"page", "page_size", "format"}
# The query parameters of DRF's paginators and filter backends, by the attribute that names each.
_PARAM_ATTRIBUTES = ("page_query_param", "page_size_query_param", "limit_query_param", "offset_query_param",
                     "cursor_query_param", "ordering_param", "search_param")


def _reject(request: Request, allowed: Iterable[str]) -> None:
    unknown = sorted(set(request.query_params) - set(allowed) - {api_settings.URL_FORMAT_OVERRIDE})
    if unknown:
        raise ValidationError({name: ["Unknown query parameter."] for name in unknown})


def reject_unknown_params(request: Request, allowed: Iterable[str], *, paginated: bool = True) -> None:
    """A misspelt filter would otherwise be ignored and return everything: name it in a 400."""
    _reject(request, set(allowed) | PAGINATION_PARAMS if paginated else allowed)


def takes_several_values(field: forms.Field) -> bool:
    """Whether a filter's form field reads every value of its parameter (`?gpu_model=a&gpu_model=b`): a multiple
    choice, a model one, or a field whose widget reads them all. Every other field reads the last value alone."""
    return (isinstance(field, forms.MultipleChoiceField | forms.ModelMultipleChoiceField)
            or getattr(field.widget, "allow_multiple_selected", False))


class StrictFilterSet(django_filters.FilterSet):
    """`?country=` names a filter and gives it nothing; django-filter would drop it and return everything. And
    `?min_gpus=4&min_gpus=1` gives a filter of one value two: Django's form would read the last one alone, silently
    (found by review); a 400 names it, except for filters that take several values (a multiple choice)."""

    def is_valid(self) -> bool:
        valid = super().is_valid()
        data = self.data
        assert isinstance(data, QueryDict)  # the query parameters (DjangoFilterBackend passes query_params)
        fields = self.form.fields
        for name in self.filters:
            values = data.getlist(name) if name in data else []
            if any(value.strip() == "" for value in values):
                self.form.add_error(name, "Give a value, or leave the parameter out.")
                valid = False
            elif len(values) > 1 and name in fields and not takes_several_values(fields[name]):
                self.form.add_error(name, "Give this parameter once: it takes one value.")
                valid = False
        return valid


def _generic_action(request: Request, view: APIView) -> str | None:
    """What a GET of a generic view (not a viewset) is: the detail of one object when its URL names one."""
    if request.method not in ("GET", "HEAD"):
        return None
    lookup = getattr(view, "lookup_url_kwarg", None) or getattr(view, "lookup_field", "pk")
    return "retrieve" if lookup in getattr(view, "kwargs", {}) else "list"


class FilterBackend(DjangoFilterBackend):
    """DjangoFilterBackend whose generated filtersets (from `filterset_fields`) are strict too, and that refuses,
    on a list or a retrieve, every query parameter the view does not read: its filters, its paginator's and its
    filter backends' parameters, `format`, and those it names in `known_query_params` (read by the view itself).
    Other actions (a view's own, with their own parameters) are left to the view."""

    filterset_base = StrictFilterSet

    def filter_queryset(self, request: HttpRequest, queryset: QuerySet[Any], view: APIView) -> QuerySet[Any]:
        assert isinstance(request, Request)  # DRF's (the stubs say HttpRequest)
        self.reject_unknown_params(request, queryset, view)
        return super().filter_queryset(request, queryset, view)

    def reject_unknown_params(self, request: Request, queryset: QuerySet[Any], view: APIView) -> None:
        action = getattr(view, "action", None) if hasattr(view, "action") else _generic_action(request, view)
        if action == "list":
            _reject(request, self.known_params(request, queryset, view))
        elif action == "retrieve":
            _reject(request, ())  # one object: no filter or page applies to it

    def known_params(self, request: Request, queryset: QuerySet[Any], view: APIView) -> set[str]:
        filterset_class = self.get_filterset_class(view, queryset)
        known = set(filterset_class.base_filters) if filterset_class is not None else set()
        known.update(getattr(view, "known_query_params", ()))
        for part in [getattr(view, "paginator", None), *getattr(view, "filter_backends", ())]:
            known.update(name for name in (getattr(part, a, None) for a in _PARAM_ATTRIBUTES) if name)
        return known
