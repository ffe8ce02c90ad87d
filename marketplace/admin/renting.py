"""The operators' panel for rentals: images, instances (stop and destroy), their interruptions, volumes."""
from django import forms
from django.contrib import admin, messages

from core.admin_history import History, HistoryAdmin
from core.admin_paginator import EstimatedCountPaginator
from core.errors import ApplicationError
from marketplace.admin.common import NothingEditableAdmin, OwnChangesAdmin, OwnChangesForm
from marketplace.models import (
    GpuAllocation,
    Image,
    Instance,
    Interruption,
    Volume,
)
from marketplace.money import micros_to_usd
from marketplace.services.instances import instance_destroy, instance_stop
from marketplace.services.instances.options import clean_image_reference
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
class InterruptionAdmin(NothingEditableAdmin, admin.ModelAdmin):
    """Every interruption of the fleet: which nodes lose renters' instances, and what it cost their providers."""

    list_display = ["id", "instance", "node", "cause", "started_at", "detected_at", "ended_at", "outcome", "credited"]
    # Grows with the platform's life, read on every page: newest first by the primary key's index (the model's order,
    # newest first by its start, has none and sorted the whole table), counted once, estimated when unfiltered and
    # large (core/admin_paginator.py; found by review).
    ordering = ["-id"]
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    list_filter = ["cause", "outcome"]
    search_fields = ["=instance__id", "instance__node__name", "instance__renter__email"]
    list_select_related = ["instance__node"]
    date_hierarchy = "started_at"
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


@admin.register(Instance)
class InstanceAdmin(NothingEditableAdmin, HistoryAdmin):
    list_display = ["id", "renter", "node", "gpu_model", "num_gpus", "image", "status", "price", "created_at",
                    "started_at"]
    # Grows with the platform's life, read on every page: newest first by the primary key's index (the model's order,
    # newest first by its creation, has none and sorted the whole table), counted once, estimated when unfiltered and
    # large (core/admin_paginator.py; found by review).
    ordering = ["-id"]
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    list_filter = ["status", "node__runtime", "gpu_model", "image"]
    search_fields = ["=id", "renter__email", "node__name", "node__address", "label"]
    list_select_related = ["renter", "node", "gpu_model", "image"]
    date_hierarchy = "created_at"
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

    def has_add_permission(self, request):
        return False  # instances are booked through the API, which allocates GPUs

    def has_delete_permission(self, request, obj=None):
        return False  # destroy instead: the VM on the node must go too

    @admin.display(ordering="price_per_hour_micros", description="USD/h")
    def price(self, instance):
        return micros_to_usd(instance.price_per_hour_micros)

    def _apply(self, request, queryset, service, verb):
        done, refused = 0, []
        for instance in queryset:
            try:
                service(instance=instance)
                done += 1
            except ApplicationError as exc:
                refused.append(f"instance {instance.pk}: {exc}")
        messages.info(request, f"{done} instance(s) {verb}.")
        for line in refused:
            messages.warning(request, line)

    @admin.action(description="Stop selected running instances (keeps the disk, frees the GPUs)",
                  permissions=["change"])  # marketplace.change_instance: view-only staff run no action
    def force_stop(self, request, queryset):
        self._apply(request, queryset, instance_stop, "stopping")

    @admin.action(description="Destroy selected instances (VM and disk)", permissions=["change"])
    def force_destroy(self, request, queryset):
        self._apply(request, queryset, instance_destroy, "destroying")


@admin.register(Volume)
class VolumeAdmin(NothingEditableAdmin, admin.ModelAdmin):
    """Renters' volumes, read-only: they are created, mounted and deleted through the API and the pages (the
    deletion needs the owner's confirmation), and billed by billing.services.storage."""

    list_display = ["name", "owner", "node", "size_gb", "state", "price_per_gb_month_micros", "cost_micros",
                    "created_at"]
    # Grows with the platform's life, read on every page: newest first by the primary key's index (the model's order,
    # newest first by its creation, has none and sorted the whole table), counted once, estimated when unfiltered and
    # large (core/admin_paginator.py; found by review).
    ordering = ["-id"]
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    list_filter = ["state"]
    search_fields = ["name", "owner__email", "label"]
    list_select_related = ["owner", "node"]
    fields = ["name", "label", "owner", "node", "size_gb", "state", "status_message", "price_per_gb_month_micros",
              "platform_fee_bps", "billed_until", "billed_seconds", "cost_micros", "created_at", "available_at",
              "deleted_at"]
    readonly_fields = fields  # type: ignore[assignment]  # names only here; django-stubs types `fields` as groups

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
