"""django-filter for the API: a filter given without a value is a 400, not silently ignored."""
import django_filters
from django_filters.rest_framework import DjangoFilterBackend
from rest_framework.exceptions import ValidationError

PAGINATION_PARAMS = {"page", "page_size", "format"}


def reject_unknown_params(request, allowed) -> None:
    """A misspelt filter would otherwise be ignored and return everything: name it in a 400."""
    unknown = sorted(set(request.query_params) - set(allowed) - PAGINATION_PARAMS)
    if unknown:
        raise ValidationError({name: ["Unknown query parameter."] for name in unknown})


class StrictFilterSet(django_filters.FilterSet):
    """`?country=` names a filter and gives it nothing; django-filter would drop it and return everything."""

    def is_valid(self):
        valid = super().is_valid()
        for name in self.filters:
            if name in self.data and any(value.strip() == "" for value in self.data.getlist(name)):
                self.form.add_error(name, "Give a value, or leave the parameter out.")
                valid = False
        return valid


class FilterBackend(DjangoFilterBackend):
    """DjangoFilterBackend whose generated filtersets (from `filterset_fields`) are strict too."""

    filterset_base = StrictFilterSet
