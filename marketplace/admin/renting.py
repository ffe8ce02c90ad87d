"""The operators' panel for rentals: images, instances (stop and destroy), their interruptions, volumes."""
import datetime

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ActionForm
from django.db import connections, models
from django.utils import formats, timezone
from django.utils.dateparse import parse_datetime
from django.utils.functional import cached_property

from core.admin_history import History, HistoryAdmin
from core.admin_paginator import EstimatedCountPaginator
from core.admin_search import KeySearchAdmin
from core.errors import ApplicationError
from marketplace.admin.common import (
    STAFF_ACCOUNT_REFUSED,
    NothingEditableAdmin,
    OwnChangesAdmin,
    OwnChangesForm,
    staff_of_a_non_superuser,
)
from marketplace.models import (
    GpuAllocation,
    Image,
    Instance,
    Interruption,
    Volume,
    VolumeState,
)
from marketplace.money import micros_to_usd
from marketplace.services.account_status import REASON_MAX_LENGTH, status_reason_clean
from marketplace.services.instances import instance_end_by_operator
from marketplace.services.instances.options import clean_image_reference
from marketplace.services.volumes import volume_mark_lost
from marketplace.validators import validate_libvirt_image


class ImageForm(OwnChangesForm, forms.ModelForm):
    """A catalogue image's names are checked as the nodes take them: the container image as a renter's own reference
    (clean_image_reference, the booking's rule), the libvirt image by the agent's pattern. Before, anything was
    saved, and every rental of the image failed on its node ("pytorch/pytorch latest", "ubuntu 22.04.qcow2").

    Only what the operator changed on the page is written, refused where another operator changed it since
    (OwnChangesForm): the whole row written as shown put an image taken off the catalogue meanwhile back on it
    (`active`), or an older container image back under its rentals, by a Save made for its description (found by
    review)."""

    class Meta:
        model = Image
        fields = ["name", "slug", "description", "docker_image", "libvirt_image", "min_disk_gb", "active"]

    def clean_docker_image(self):
        value = self.cleaned_data["docker_image"]
        if value:
            try:
                clean_image_reference(value, "docker_image")
            except ApplicationError as exc:
                raise forms.ValidationError(exc.message) from None
        return value

    def clean_libvirt_image(self):
        value = self.cleaned_data["libvirt_image"]
        if value:
            validate_libvirt_image(value)
        return value


@admin.register(Image)
class ImageAdmin(OwnChangesAdmin, admin.ModelAdmin):
    form = ImageForm
    list_display = ["name", "slug", "docker_image", "libvirt_image", "min_disk_gb", "active"]
    list_filter = ["active"]
    search_fields = ["name", "slug", "docker_image", "libvirt_image"]
    prepopulated_fields = {"slug": ["name"]}


def _period(year: int, month: int | None = None, day: int | None = None) -> tuple[datetime.datetime, datetime.datetime]:
    """A year, a month or a day, from its first moment to the next one's, in the current time zone."""
    zone = timezone.get_current_timezone()
    start = datetime.datetime(year, month or 1, day or 1, tzinfo=zone)
    if day is not None:
        end = datetime.datetime.combine(start.date() + datetime.timedelta(days=1), datetime.time(), tzinfo=zone)
    elif month is not None:
        end = datetime.datetime(year + month // 12, month % 12 + 1, 1, tzinfo=zone)
    else:
        end = datetime.datetime(year + 1, 1, 1, tzinfo=zone)
    return start, end


class DateDrillDown(admin.DateFieldListFilter):
    """Django's date filter (any date, today, the past 7 days, this month, this year) and a drill-down: the years
    that have rows, the chosen year's months that have rows, the chosen month's days that have rows. Every choice is
    a range on the column (`<field>__gte`, `<field>__lt`), read in its index.

    It replaces the lists' date_hierarchy, which on every opening of the list read the whole table twice: MIN and
    MAX of the column with no index, then SELECT DISTINCT date_trunc('year', ...) over every row (and with a year
    chosen, every row of the year for its months), 150 ms at 200,000 instances and growing with the platform's
    life. Here the bounds are a MIN and a MAX read at the ends of the column's index, and which periods have rows
    one query of a MIN per period, each read in the index (PostgreSQL plans a MIN as the index's first entry in
    the range; an EXISTS or LIMIT 1 can be planned as a sequential scan, which on a table written in time order
    reads all the older rows first). The periods are those of the whole table, not of the list's other filters (a
    period may then list nothing); years, months and days are those of the current time zone (UTC)."""

    def __init__(self, field, request, params, model, model_admin, field_path):
        super().__init__(field, request, params, model, model_admin, field_path)
        self.model = model

    @property  # Django's class sets `links` in its __init__: the relative links, followed here by the drill-down
    def links(self):
        return self.relative_links + self.drill_down

    @links.setter
    def links(self, value):
        self.relative_links = value

    @cached_property
    def drill_down(self) -> tuple:
        """The links to the years, and to the months and days of the one chosen (read once, when the list shows
        its filters)."""
        first_last = self.model._default_manager.aggregate(first=models.Min(self.field_path),
                                                           last=models.Max(self.field_path))
        if first_last["first"] is None:
            return ()
        first, last = (timezone.localtime(first_last[end]) for end in ("first", "last"))
        periods: list[tuple[tuple[int, ...], tuple[datetime.datetime, datetime.datetime]]]
        periods = [((year,), _period(year)) for year in range(first.year, min(last.year, datetime.MAXYEAR - 1) + 1)]
        chosen = self.chosen_month()
        if chosen is not None:
            year, month = chosen
            periods += [((year, m), _period(year, m)) for m in range(1, 13)]
            if month is not None:
                days = (_period(year, month)[1] - datetime.timedelta(days=1)).day
                periods += [((year, month, d), _period(year, month, d)) for d in range(1, days + 1)]
        found = self.with_rows([bounds for _, bounds in periods])
        shown = sorted(key for (key, _), there in zip(periods, found, strict=True) if there)
        links = []
        for key in shown:
            start, end = _period(*key)
            title = (str(key[0]) if len(key) == 1 else formats.date_format(start, "YEAR_MONTH_FORMAT")
                     if len(key) == 2 else formats.date_format(start, "DATE_FORMAT"))
            links.append((title, {self.lookup_kwarg_since: start, self.lookup_kwarg_until: end}))
        return tuple(links)

    def chosen_month(self) -> tuple[int, int | None] | None:
        """(year, None) when one of the drill-down's years is chosen, (year, month) when one of its months or days
        is; None for any other range (the relative links, a hand-written one, one that does not parse).

        A hand-written bound is read in the current time zone before its year is judged: judged as written, one
        with an offset passed the check and failed after it (`0001-01-01 00:00+05:00` is in year 0 in UTC, an
        OverflowError; `9998-12-31 23:00-05:00` is 9999 in UTC, whose next year _period cannot make), a 500 on the
        list (found by review). Such a range is no period of the drill-down: the list is filtered by it as written,
        as by any other hand-written range."""
        try:
            since = parse_datetime(self.date_params.get(self.lookup_kwarg_since, ""))
            until = parse_datetime(self.date_params.get(self.lookup_kwarg_until, ""))
            if since is None or until is None or timezone.is_naive(since):
                return None
            since = timezone.localtime(since)
        except (ValueError, OverflowError):
            return None
        if since.year >= datetime.MAXYEAR:  # the drill-down's own years: _period(9999) has no next year
            return None
        for key in ((since.year,), (since.year, since.month), (since.year, since.month, since.day)):
            if _period(*key) == (since, until):
                return key[0], (key[1] if len(key) > 1 else None)
        return None

    def with_rows(self, periods: list[tuple[datetime.datetime, datetime.datetime]]) -> list[bool]:
        """Whether each period has a row: one query, SELECT (SELECT MIN(column) ... in the period), ..."""
        if not periods:
            return []
        connection = connections[self.model._default_manager.db]
        table = connection.ops.quote_name(self.model._meta.db_table)
        assert self.field.column is not None  # the list's own date field, a concrete column
        column = connection.ops.quote_name(self.field.column)
        one = f"(SELECT MIN({column}) FROM {table} WHERE {column} >= %s AND {column} < %s)"  # noqa: S608 (quoted)
        params = [self.field.get_db_prep_value(moment, connection) for period in periods for moment in period]
        with connection.cursor() as cursor:
            cursor.execute("SELECT " + ", ".join([one] * len(periods)), params)
            row = cursor.fetchone()
        return [value is not None for value in row]


# An instance's history on its page: the latest rows, and a link to all of them (inlines showed every one; an
# instance gets a set of allocations at each start, and an interruption each time its node or VM is lost).
instance_allocations = History(
    GpuAllocation, "instance",
    ["gpu", ("index", lambda allocation: allocation.gpu.index), "allocated_at", "released_at"],
    ordering=["-allocated_at", "gpu__index", "-id"], select_related=["gpu"], title="GPU allocations")
instance_interruptions = History(
    Interruption, "instance",
    ["cause", "detail", "started_at", "detected_at", "ended_at", "outcome", "credited_seconds",
     ("credited USD", lambda interruption: micros_to_usd(interruption.credited_micros))],
    title="Interruptions")


@admin.register(Interruption)
class InterruptionAdmin(NothingEditableAdmin, KeySearchAdmin):  # the id by its index (core/admin_search.py)
    """Every interruption of the fleet: which nodes lose renters' instances, and what it cost their providers."""

    list_display = ["id", "instance", "node", "cause", "started_at", "detected_at", "ended_at", "outcome", "credited"]
    # Grows with the platform's life, read on every page: newest first by the primary key's index (the model's order,
    # newest first by its start, has none and sorted the whole table), counted once, estimated when unfiltered and
    # large (core/admin_paginator.py; found by review).
    ordering = ["-id"]
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    list_filter = ["cause", "outcome", ("started_at", DateDrillDown)]  # not date_hierarchy (DateDrillDown's why)
    search_fields = ["=instance__id", "instance__node__name", "instance__renter__email"]
    list_select_related = ["instance__node"]
    readonly_fields = ["instance", "cause", "detail", "started_at", "detected_at", "ended_at", "outcome",
                       "credited_seconds", "credited_micros"]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    @admin.display(description="node")
    def node(self, interruption):
        return interruption.instance.node

    @admin.display(ordering="credited_micros", description="credited USD")
    def credited(self, interruption):
        return micros_to_usd(interruption.credited_micros)


class InstanceActionForm(ActionForm):
    """The list's actions bar, with the reason the stop and destroy actions tell the renters."""

    reason = forms.CharField(label="Reason:", required=False, max_length=REASON_MAX_LENGTH,
                             help_text="Told to the instance's renter (e-mail, webhooks, their list).")


@admin.register(Instance)
class InstanceAdmin(NothingEditableAdmin, KeySearchAdmin, HistoryAdmin):  # the id by its index: core/admin_search
    list_display = ["id", "renter", "node", "gpu_model", "num_gpus", "image", "status", "price", "created_at",
                    "started_at"]
    # Grows with the platform's life, read on every page: newest first by the primary key's index (the model's order,
    # newest first by its creation, has none and sorted the whole table), counted once, estimated when unfiltered and
    # large (core/admin_paginator.py; found by review).
    ordering = ["-id"]
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    list_filter = ["status", "node__runtime", "gpu_model", "image",
                   ("created_at", DateDrillDown)]  # not date_hierarchy (DateDrillDown's why)
    search_fields = ["=id", "renter__email", "node__name", "node__address", "label"]
    list_select_related = ["renter", "node", "gpu_model", "image"]
    # Everything is read-only: state changes go through the actions, which call the services.
    # Of a renter's options, what operators need to follow an instance; never the registry password (only whether
    # one was given), nor the env's values (only their names), nor the onstart script. Nor the create's fingerprint:
    # those stored before the script was key-hashed in it are a plain SHA-256 of a body whose other fields the page
    # shows, so a guess at the script could be checked offline (found by review).
    fields = ["renter", "node", "gpu_model", "num_gpus", "image", "image_ref", "registry_auth", "env_names",
              "ports_requested", "ports", "min_cuda_version", "os", "label", "disk_gb", "status", "status_message",
              "ssh_host", "ssh_port", "ssh_user", "ssh_public_keys", "price_per_gpu_hour_micros",
              "price_per_hour_micros", "idempotency_key", "created_at", "started_at", "stopped_at", "destroyed_at",
              "updated_at"]
    readonly_fields = fields  # type: ignore[assignment]  # names only here; django-stubs types `fields` as groups
    latest_allocations, latest_interruptions = instance_allocations, instance_interruptions
    histories = ["latest_allocations", "latest_interruptions"]
    actions = ["force_stop", "force_destroy"]
    action_form = InstanceActionForm

    def has_add_permission(self, request):
        return False  # instances are booked through the API, which allocates GPUs

    def has_delete_permission(self, request, obj=None):
        return False  # destroy instead: the VM on the node must go too

    @admin.display(ordering="price_per_hour_micros", description="USD/h")
    def price(self, instance):
        return micros_to_usd(instance.price_per_hour_micros)

    def _apply(self, request, queryset, action, verb, logged):
        """Each instance through the renter's own service, with the renter told that an operator did it and why
        (instance_end_by_operator), not a staff account's for a non-superuser (the users' rule,
        common.staff_of_a_non_superuser); each one done recorded in the admin's log with the operator (LogEntry:
        the instance's history page), not one refused or already on its way (asked again, the service changes
        nothing and tells nobody)."""
        try:
            reason = status_reason_clean(request.POST.get("reason", ""))
        except ApplicationError as exc:
            messages.error(request, f"Nothing done: {exc}")
            return
        done, refused = 0, []
        for instance in queryset.select_related("renter"):
            if staff_of_a_non_superuser(request.user, instance.renter):
                refused.append(f"instance {instance.pk}: {STAFF_ACCOUNT_REFUSED} ({instance.renter.email}); left "
                               "as it is.")
                continue
            try:
                after = instance_end_by_operator(instance=instance, action=action, reason=reason)
                done += 1
                if after.status != instance.status:
                    self.log_change(request, instance, f"{logged} (now {after.status})"
                                    + (f": {reason}" if reason else "") + ".")
            except ApplicationError as exc:
                refused.append(f"instance {instance.pk}: {exc}")
        messages.info(request, f"{done} instance(s) {verb}.")
        for line in refused:
            messages.warning(request, line)

    @admin.action(description="Stop selected running instances (keeps the disk, frees the GPUs; with the reason "
                              "above, told to the renter)",
                  permissions=["change"])  # marketplace.change_instance: view-only staff run no action
    def force_stop(self, request, queryset):
        self._apply(request, queryset, "stop", "stopping", "Stopped from the admin")

    @admin.action(description="Destroy selected instances (VM and disk; with the reason above, told to the renter)",
                  permissions=["change"])
    def force_destroy(self, request, queryset):
        self._apply(request, queryset, "destroy", "destroying", "Destroyed from the admin")


@admin.register(Volume)
class VolumeAdmin(NothingEditableAdmin, admin.ModelAdmin):
    """Renters' volumes, read-only: they are created, mounted and deleted through the API and the pages (the
    deletion needs the owner's confirmation), and billed by billing.services.storage. One action: end a volume its
    node's list did not have (`missing_since`, a `volume_missing` node event) as lost, without waiting for the
    reconciler's next look (which would end it if it misses it again)."""

    list_display = ["name", "owner", "node", "size_gb", "state", "price_per_gb_month_micros", "cost_micros",
                    "created_at"]
    # Grows with the platform's life, read on every page: newest first by the primary key's index (the model's order,
    # newest first by its creation, has none and sorted the whole table), counted once, estimated when unfiltered and
    # large (core/admin_paginator.py; found by review).
    ordering = ["-id"]
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    list_filter = ["state", ("missing_since", admin.EmptyFieldListFilter)]
    search_fields = ["name", "owner__email", "label"]
    list_select_related = ["owner", "node"]
    fields = ["name", "label", "owner", "node", "size_gb", "state", "status_message", "price_per_gb_month_micros",
              "platform_fee_bps", "billed_until", "billed_seconds", "cost_micros", "created_at", "available_at",
              "missing_since", "deleted_at"]
    readonly_fields = fields  # type: ignore[assignment]  # names only here; django-stubs types `fields` as groups
    actions = ["end_lost"]

    @admin.action(description="End selected volumes missing on their server as lost (billed up to the check that "
                              "missed them; their renters told)", permissions=["change"])
    def end_lost(self, request, queryset):
        ended, refused = 0, []
        for volume in queryset.select_related("owner").order_by("pk"):
            # A staff account's volume is a superuser's to end, as its instances and nodes are (_apply,
            # NodeAdmin._allowed): a non-superuser with change_volume ended a superuser's (review r53).
            if staff_of_a_non_superuser(request.user, volume.owner):
                refused.append(f"volume {volume.pk} ({volume.name}): {STAFF_ACCOUNT_REFUSED} ({volume.owner.email}); "
                               "left as it is")
                continue
            after = volume_mark_lost(volume_id=volume.pk, by=request.user.email)
            if after is not None and after.state == VolumeState.DELETED and volume.state != VolumeState.DELETED:
                ended += 1
                self.log_change(request, after, "Ended as lost on its server from the admin.")
            else:
                refused.append(f"volume {volume.pk} ({volume.name}): not ended, it is {volume.state}"
                               f"{'' if volume.missing_since else ' and was not found missing on its server'}; "
                               "only an available volume a check found missing is ended here")
        messages.info(request, f"{ended} volume(s) ended as lost.")
        for line in refused:
            messages.warning(request, line)

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
