"""The project's admin site: Django's, with one rule for every list it shows, whichever app registers the model.

A list's query string filters it. Its own filters (list_filter, the date hierarchy) read their parameters and check
their values; Django applies every other parameter that names a field as a lookup, as written (core/admin_history.py
links `?node__id__exact=5` so). Django turns the errors raised while such a filter is built into its "invalid
lookup" answer (the list again, unfiltered, with ?e=1), but some values fail only when the SQL is compiled or run:
?created_at__year=99999 (a year past datetime's range), iso_year, an invalid regular expression (__regex, a
DataError), __range with other than two values, __contained_by on a plain column, text for a binary column; and
the date hierarchy's own year, month or day beyond a C long (an OverflowError where Django expects a ValueError).
Each was a 500 on every list with such a field. Those parameters are now tried once, in a savepoint, before the
list uses them, and any failure gets the same answer as a misspelt field. A subclass of the site, not a check per
lookup: the lookups are Django's and PostgreSQL's to judge, and whatever a later list or lookup adds is covered.

Installed in place of django.contrib.admin (config/settings/base.py, INSTALLED_APPS: `AdminConfig` below), as
Django documents for overriding the default site: `admin.site` is this site.
"""
from __future__ import annotations

from functools import cache
from typing import Any

from django.contrib import admin
from django.contrib.admin.apps import AdminConfig as DjangoAdminConfig
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.utils import build_q_object_from_lookup_parameters
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import ImproperlyConfigured, SuspiciousOperation
from django.db import router, transaction
from django.http import HttpRequest


class _TriedLookups:
    """A ChangeList that runs the query string's own lookups once before the list does (an EXISTS, in a savepoint:
    a failed statement does not abort the request's transaction). No parameter, no query."""

    model: Any
    root_queryset: Any

    def get_filters(self, request: HttpRequest) -> Any:
        try:
            filters = super().get_filters(request)  # type: ignore[misc]
        except OverflowError as exc:  # the date hierarchy's ?started_at__year=<30 digits>: Django takes ValueError
            raise IncorrectLookupParameters(exc) from exc
        remaining = filters[2]  # what no list filter took: applied as written
        if remaining and not getattr(self, "_lookups_tried", False):
            try:
                with transaction.atomic(using=router.db_for_read(self.model)):
                    self.root_queryset.filter(build_q_object_from_lookup_parameters(remaining)).exists()
            except (SuspiciousOperation, ImproperlyConfigured):
                raise  # as Django's own step: a lookup it forbids is a 400, a broken admin its error
            except Exception as exc:
                # As Django's own step, which catches every error of building the filter: there is no other way
                # of validating a lookup's value than the database's answer.
                raise IncorrectLookupParameters(exc) from exc
            self._lookups_tried = True
        return filters


@cache
def _tried(changelist: type[ChangeList]) -> type[ChangeList]:
    return type(changelist.__name__, (_TriedLookups, changelist), {"__module__": changelist.__module__})


class _TriedLookupsAdmin:
    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return _tried(super().get_changelist(request, **kwargs))  # type: ignore[misc]


class AdminSite(admin.AdminSite):
    def register(self, model_or_iterable: Any, admin_class: type[admin.ModelAdmin[Any]] | None = None,
                 **options: Any) -> None:
        """Every ModelAdmin with the tried lookups of its lists: a subclass made here, as Django's own register
        makes one for `options`."""
        base = admin_class or admin.ModelAdmin
        if not issubclass(base, _TriedLookupsAdmin):
            base = type(base.__name__, (_TriedLookupsAdmin, base),
                        {"__module__": base.__module__, "__qualname__": base.__qualname__, "__doc__": base.__doc__})
        return super().register(model_or_iterable, base, **options)


class AdminConfig(DjangoAdminConfig):
    default_site = "core.admin_site.AdminSite"
