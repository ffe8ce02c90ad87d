"""django-filter for the API: a filter given without a value is a 400, not silently ignored."""
from collections.abc import Iterable

import django_filters
from django.http import QueryDict
from django_filters.rest_framework import DjangoFilterBackend
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request

PAGINATION_PARAMS = {"page", "page_size", "format"}


def reject_unknown_params(request: Request, allowed: Iterable[str]) -> None:
    """A misspelt filter would otherwise be ignored and return everything: name it in a 400."""
    unknown = sorted(set(request.query_params) - set(allowed) - PAGINATION_PARAMS)
    if unknown:
        raise ValidationError({name: ["Unknown query parameter."] for name in unknown})


class StrictFilterSet(django_filters.FilterSet):
    """`?country=` names a filter and gives it nothing; django-filter would drop it and return everything."""

    def is_valid(self) -> bool:
        valid = super().is_valid()
        data = self.data
        assert isinstance(data, QueryDict)  # the query parameters (DjangoFilterBackend passes query_params)
        for name in self.filters:
            if name in data and any(value.strip() == "" for value in data.getlist(name)):
                self.form.add_error(name, "Give a value, or leave the parameter out.")
                valid = False
        return valid


class FilterBackend(DjangoFilterBackend):
    """DjangoFilterBackend whose generated filtersets (from `filterset_fields`) are strict too."""

    filterset_base = StrictFilterSet
