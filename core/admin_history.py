"""A record's history on its admin page (a node's events, an instance's interruptions): the latest LIMIT rows,
read-only, newest first, and a link to the filtered list of all of them.

Used instead of Django's inlines, which show every related row (max_num bounds only the rows one may add) and give
each one hidden form inputs: a node with 3,000 events rendered 3,000 rows, and from about 490 its page could no
longer be saved (past DATA_UPLOAD_MAX_NUMBER_FIELDS, Django refuses the form). Here the rows are a table, with no
form field, read with one query of LIMIT + 1 rows (and a count only when there are more).
"""
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.contrib.admin.utils import display_for_field
from django.db.models import Field, Model
from django.http import HttpRequest
from django.urls import NoReverseMatch, reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

LIMIT = 20
EMPTY = "-"

# A column: a field of the related model (shown as the admin shows it), or (heading, function of the row).
Column = str | tuple[str, Callable[[Any], Any]]


class History:
    """One history on an admin page: `name = History(...)` on a HistoryAdmin, and `histories = ["name", ...]`."""

    def __init__(self, model: type[Model], fk: str, columns: Sequence[Column], *, title: str,
                 ordering: Sequence[str] = (), select_related: Sequence[str] = (), limit: int = LIMIT):
        self.model, self.fk, self.columns, self.limit = model, fk, list(columns), limit
        self.ordering, self.select_related = list(ordering), list(select_related)  # ordering: newest first
        self.title = title  # its section's heading on the page
        self.short_description = "newest first"  # the admin's label for a read-only field

    @property
    def view_permission(self) -> str:
        return f"{self.model._meta.app_label}.view_{self.model._meta.model_name}"

    def __call__(self, obj: Model) -> SafeString:
        rows_qs = self.model._default_manager.filter(**{self.fk: obj})
        ordered = rows_qs.order_by(*self.ordering) if self.ordering else rows_qs  # else the model's own
        rows = list(ordered.select_related(*self.select_related)[:self.limit + 1])
        if not rows:
            return SafeString(EMPTY)
        more = len(rows) > self.limit
        rows = rows[:self.limit]
        head = format_html_join("", "<th scope=\"col\">{}</th>", ((self._heading(c),) for c in self.columns))
        body = format_html_join("", "<tr>{}</tr>", ((format_html_join(
            "", "<td>{}</td>", ((self._cell(row, c),) for c in self.columns)),) for row in rows))
        table = format_html("<table class=\"admin-history\"><thead><tr>{}</tr></thead><tbody>{}</tbody></table>",
                            head, body)
        link = self._all_link(obj)
        if more:
            total = rows_qs.order_by().count()
            note = (format_html("The latest {} of {}: <a href=\"{}\">all of them</a>.", self.limit, total, link)
                    if link else format_html("The latest {} of {}.", self.limit, total))
            return format_html("{}<p>{}</p>", table, note)
        return format_html("{}<p><a href=\"{}\">In the list</a></p>", table, link) if link else table

    def _field(self, name: str) -> "Field[Any, Any]":
        field = self.model._meta.get_field(name)
        assert isinstance(field, Field), f"{name}: a column is a field of the model itself"
        return field

    def _heading(self, column: Column) -> str:
        return column[0] if isinstance(column, tuple) else str(self._field(column).verbose_name)

    def _cell(self, row: Model, column: Column) -> Any:
        if isinstance(column, tuple):
            value = column[1](row)
            return EMPTY if value is None else value
        return display_for_field(getattr(row, column), self._field(column), EMPTY)

    def _all_link(self, obj: Model) -> str:
        """The related model's list filtered on this record, when the admin has one."""
        if not admin.site.is_registered(self.model):
            return ""
        meta = self.model._meta
        try:
            url = reverse(f"admin:{meta.app_label}_{meta.model_name}_changelist")
        except NoReverseMatch:
            return ""
        return f"{url}?{self.fk}__id__exact={obj.pk}"


if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[Any]  # generic in django-stubs only
else:
    _ModelAdmin = admin.ModelAdmin


class HistoryAdmin(_ModelAdmin):
    """A ModelAdmin showing `histories` (names of History attributes) on its change page, each in its own section
    after the fields, and each only to the holders of its model's view permission (as an inline was)."""

    histories: Sequence[str] = ()

    def _shown_histories(self, request: HttpRequest) -> list[str]:
        return [name for name in self.histories if request.user.has_perm(getattr(self, name).view_permission)]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [*super().get_readonly_fields(request, obj), *self.histories]

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> list[Any]:
        fieldsets = list(super().get_fieldsets(request, obj))
        if obj is None:
            return fieldsets
        return fieldsets + [(getattr(self, name).title, {"fields": [name]})
                            for name in self._shown_histories(request)]
