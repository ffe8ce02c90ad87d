"""An admin list's search for an id: the key column compared with the number, which its index answers.

Django searches every search field as text: "=instance__id" is iexact, UPPER("instance_id"::text) = UPPER('5'), and
a plain "id" is icontains, UPPER("id"::text) LIKE UPPER('%5%') (instance 5 finding 15, 50, 105). Neither is served
by the column's btree index, so each search of a large list (the usage intervals: a row per instance per meter run)
read the whole table. KeySearchAdmin searches each field that names an integer or UUID column (the column itself or
through relations, a foreign key as its target's key) with `field=value` when the term reads as such a value, and
not at all when it does not (no integer column's text equals "abc"; "05" now finds 5); the other fields as Django
does. One term matches a row when any field matches it; every term must match, as in Django.

A term that is a key also searches the text fields, as Django did (a job's "5" finds job 5 and the jobs on node
"gpu5"), unless the admin sets `key_terms_search_keys_only`: then a number is an id and only an id, and the key's
index alone answers (an OR with a LIKE over a join is a scan of the whole table again). For the largest lists,
whose text fields hold nothing an operator looks for by a bare number.
"""
from __future__ import annotations

import re
import uuid
from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.contrib.admin.utils import lookup_spawns_duplicates
from django.core.exceptions import FieldDoesNotExist, ValidationError
from django.db import models
from django.db.models.constants import LOOKUP_SEP
from django.db.models.functions import Cast
from django.http import HttpRequest
from django.utils.text import smart_split, unescape_string_literal

# ASCII digits only: int() also reads "٥", "1_0" and "+5", which no operator means as an id.
DIGITS = re.compile(r"[0-9]+")


def _walk(model: type[models.Model], path: str) -> tuple[list[str], Any, list[str]]:
    """A search field's path as Django follows it: (the field names, the last field, the parts after them: a
    lookup and what follows it, or a name that is neither)."""
    opts: Any = model._meta
    parts = path.split(LOOKUP_SEP)
    field: Any = None
    for i, part in enumerate(parts):
        try:
            field = opts.get_field(opts.pk.name if part == "pk" else part)
        except FieldDoesNotExist:
            return parts[:i], field, parts[i:]
        if hasattr(field, "path_infos"):
            opts = field.path_infos[-1].to_opts
    return parts, field, []


def key_field(model: type[models.Model], search_field: str) -> tuple[str, models.Field[Any, Any]] | None:
    """(the path to filter by, the key field) where `search_field` names an integer or UUID column, searched
    exactly or as Django's default (icontains) or iexact ("="); None for any other field or prefix ("^", "@")."""
    if search_field[:1] in ("^", "@"):
        return None
    names, field, rest = _walk(model, search_field.removeprefix("="))
    if field is None or rest not in ([], ["exact"], ["iexact"]):
        return None
    if field.is_relation:
        if not (field.concrete and (field.many_to_one or field.one_to_one)):
            return None  # a reverse or many-to-many relation: rows, not a column
        field = field.target_field  # a foreign key compared with its target's key: `instance=5`
    if isinstance(field, models.IntegerField | models.UUIDField):  # AutoField and BigAutoField are IntegerFields
        return LOOKUP_SEP.join(names), field
    return None


def key_value(field: models.Field[Any, Any], term: str) -> int | uuid.UUID | None:
    """`term` as a value of the key `field`, or None where no row's key can equal it."""
    if isinstance(field, models.UUIDField):
        try:
            return uuid.UUID(term)
        except ValueError:
            return None
    if not DIGITS.fullmatch(term):
        return None
    value = int(term)
    try:
        field.run_validators(value)  # the column's range: past it no row has the key (and the query would fail)
    except ValidationError:
        return None
    return value


def _text_lookup(model: type[models.Model], search_field: str) -> tuple[str, Cast | None]:
    """Django's lookup for a text search field (ModelAdmin.get_search_results' construct_search)."""
    for prefix, lookup in (("^", "istartswith"), ("=", "iexact"), ("@", "search")):
        if search_field.startswith(prefix):
            return f"{search_field.removeprefix(prefix)}__{lookup}", None
    names, field, rest = _walk(model, search_field)
    if rest and field is not None and field.get_lookup(rest[0]):
        if rest[0] == "exact" and not isinstance(field, models.CharField | models.TextField):
            # Django's: an exact search of a non-text field compares its text (a date with "abc" is no error)
            return f"{'_'.join(names)}_str", Cast(LOOKUP_SEP.join(names), output_field=models.CharField())
        return search_field, None
    return f"{search_field}__icontains", None


if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[Any]  # generic in django-stubs only
else:
    _ModelAdmin = admin.ModelAdmin


class KeySearchAdmin(_ModelAdmin):
    """A ModelAdmin whose search compares its integer and UUID search fields with the term as a value (module
    docstring)."""

    key_terms_search_keys_only = False

    def get_search_results(self, request: HttpRequest, queryset: Any, search_term: str) -> tuple[Any, bool]:
        search_fields = [str(name) for name in self.get_search_fields(request)]
        keys = {name: key_field(self.model, name) for name in search_fields}
        if not search_term or not any(keys.values()):
            result: tuple[Any, bool] = super().get_search_results(request, queryset, search_term)
            return result
        texts = [_text_lookup(self.model, name) for name, key in keys.items() if key is None]
        aliases = {lookup: alias for lookup, alias in texts if alias is not None}
        if aliases:
            queryset = queryset.alias(**aliases)
        used: set[str] = set()
        terms: list[Any] = []
        for bit in smart_split(search_term):
            if bit.startswith(('"', "'")) and bit[0] == bit[-1]:
                bit = unescape_string_literal(bit)
            matches: list[Any] = []  # (lookup, value) pairs, as Q.create takes them
            for key in keys.values():
                if key is not None and (value := key_value(key[1], bit)) is not None:
                    matches.append((key[0], value))
            if not (matches and self.key_terms_search_keys_only):
                matches += [(lookup, bit) for lookup, _ in texts]
            if not matches:
                return queryset.none(), False  # a term no field can match ("abc" where only ids are searched)
            used.update(lookup for lookup, _ in matches)
            terms.append(models.Q.create(matches, connector=models.Q.OR))
        duplicates = any(lookup_spawns_duplicates(self.opts, lookup) for lookup in used)
        return queryset.filter(models.Q.create(terms)), duplicates
