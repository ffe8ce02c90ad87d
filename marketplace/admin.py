"""The operators' panel for accounts, the catalogue, nodes, GPUs and rentals. No secret is ever shown."""
from django import forms
from django.contrib import admin, messages
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth.admin import UserAdmin as BaseUserAdmin
from django.core.exceptions import ValidationError
from django.db.models import Count, Q
from django_otp.plugins.otp_static.models import StaticDevice
from django_otp.plugins.otp_totp.models import TOTPDevice

from core.errors import ApplicationError, Conflict
from marketplace.auth import ThrottledLoginFormMixin
from marketplace.models import (
    ApiKey,
    Gpu,
    GpuAllocation,
    GpuModel,
    GpuStatus,
    Image,
    Instance,
    Interruption,
    MigSlice,
    Node,
    NodeState,
    SshKey,
    User,
    Volume,
)
from marketplace.money import micros_to_usd
from marketplace.services.accounts import api_key_revoke
from marketplace.services.instances import instance_destroy, instance_stop
from marketplace.services.nodes import node_update
from marketplace.services.two_factor import two_factor_disable, two_factor_enabled
from provisioning.admin import NodeEventInline, VerificationRunInline
from provisioning.services.verification import node_accept_host_key, node_verify_request


class UserAddForm(forms.ModelForm):
    """An operator adds an account by its e-mail address only, with no usable password: its owner sets one with
    "Forgot your password?", whose e-mail proves they hold the address before the account can log in, rent or list
    (sign-up proves it the same way). README, "Accounts"."""

    class Meta:
        model = User
        fields = ["email"]

    def clean_email(self):
        email = User.objects.normalize_email(self.cleaned_data["email"]).lower()
        if User.objects.filter(email__iexact=email).exists():
            raise ValidationError("An account has this address already.")
        return email

    def save(self, commit=True):
        user = super().save(commit=False)
        user.set_unusable_password()
        if commit:
            user.save()
        return user


@admin.register(User)
class UserAdmin(BaseUserAdmin):
    ordering = ["email"]
    list_display = ["email", "is_staff", "is_active", "node_count", "date_joined", "last_login"]
    list_filter = ["is_staff", "is_active", "date_joined"]
    search_fields = ["email"]
    fieldsets = [
        (None, {"fields": ["email", "email_verified_at", "password"],
                "description": "A changed address must be verified again by its owner (the site's Security page "
                               "sends the link) before the account rents or lists."}),
        ("Permissions", {"fields": ["is_active", "is_staff", "is_superuser", "groups", "user_permissions"]}),
        ("Dates", {"fields": ["last_login", "date_joined"]}),
    ]
    readonly_fields = ["email_verified_at"]
    add_form = UserAddForm
    add_fieldsets = [(None, {"classes": ["wide"], "fields": ["email"],
                             "description": "The account gets no password: its owner sets one from the log-in "
                                            "page's “Forgot your password?”, which e-mails this address."})]

    actions = ["turn_off_two_factor"]

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(_nodes=Count("nodes"))

    def save_model(self, request, obj, form, change):
        if change and "email" in form.changed_data:
            obj.email_verified_at = None  # an operator typed it: its owner proves it (email_verification.py)
        super().save_model(request, obj, form, change)

    @admin.action(description="Turn off two-factor log-in (after checking who is asking)")
    def turn_off_two_factor(self, request, queryset):
        for user in queryset:
            two_factor_disable(user=user)
        messages.success(request, "Two-factor log-in is off for the selected accounts.")

    @admin.display(ordering="_nodes", description="nodes")
    def node_count(self, user):
        return user._nodes


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["prefix", "user", "name", "created_at", "last_used_at", "revoked_at"]
    list_filter = [("revoked_at", admin.EmptyFieldListFilter), "created_at"]
    search_fields = ["user__email", "prefix", "name"]
    # key_hash is left out on purpose: operators never need it.
    fields = ["user", "name", "prefix", "created_at", "last_used_at", "revoked_at"]
    readonly_fields = fields  # type: ignore[assignment]  # names only here; django-stubs types `fields` as groups
    list_select_related = ["user"]
    actions = ["revoke"]

    def has_add_permission(self, request):
        return False  # keys are created by their owners, who alone see the secret

    @admin.action(description="Revoke selected API keys")
    def revoke(self, request, queryset):
        for key in queryset.filter(revoked_at__isnull=True):
            api_key_revoke(api_key=key)
        messages.success(request, "Revoked.")


@admin.register(GpuModel)
class GpuModelAdmin(admin.ModelAdmin):
    list_display = ["name", "smi_name", "architecture", "memory_gb", "memory_type", "memory_bandwidth_gbps",
                    "fp32_tflops", "tf32_tflops", "bf16_tflops", "tdp_w", "pcie_gen", "mig_max_instances"]
    list_filter = ["architecture", "form_factor", "memory_type"]
    search_fields = ["name", "smi_name", "slug"]


class GpuInline(admin.TabularInline):
    model = Gpu
    fields = ["index", "uuid", "gpu_model", "memory_mib", "pci_bus_id", "status"]
    readonly_fields = ["index", "uuid", "gpu_model", "memory_mib", "pci_bus_id"]
    extra = 0
    can_delete = False


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ["name", "provider", "gpu_model", "gpu_count", "gpus_free", "price", "country", "city", "state",
                    "verdict", "listed", "score", "reliability", "state_changed_at"]
    list_filter = ["state", "verdict", "listed", "runtime", "gpu_model", "country"]
    search_fields = ["name", "address", "provider__email", "city", "datacenter", "host_key_fingerprint"]
    list_select_related = ["provider", "gpu_model"]
    # ssh_private_key_encrypted is excluded: nobody reads a private key through the admin.
    fields = ["provider", "name", "address", "ssh_port", "ssh_user", "host_key_fingerprint", "country", "city",
              "datacenter", "gpu_model", "gpu_count", "price_per_gpu_hour_micros", "runtime", "state",
              "state_changed_at", "verdict", "listed", "score", "reliability", "last_error", "next_check_at",
              "next_spot_check_at", "ssh_public_key", "created_at", "updated_at"]
    readonly_fields = ["provider", "address", "ssh_port", "ssh_user", "host_key_fingerprint", "gpu_model",
                       "gpu_count", "runtime", "state", "state_changed_at", "verdict", "score", "reliability",
                       "last_error", "next_check_at", "next_spot_check_at", "ssh_public_key", "created_at",
                       "updated_at"]  # the next checks' times: drawn at random, never shown to providers
    inlines = [GpuInline, VerificationRunInline, NodeEventInline]
    actions = ["set_maintenance", "unlist", "reverify_nodes", "accept_new_host_key"]

    def has_add_permission(self, request):
        return False  # nodes are registered by providers, which creates their key pair

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(
            _free=Count("gpus", filter=Q(gpus__status=GpuStatus.FREE))
        )

    @admin.display(ordering="_free", description="free GPUs")
    def gpus_free(self, node):
        return node._free

    @admin.display(ordering="price_per_gpu_hour_micros", description="USD/GPU-h")
    def price(self, node):
        return micros_to_usd(node.price_per_gpu_hour_micros)

    @admin.action(description="Put selected nodes into maintenance")
    def set_maintenance(self, request, queryset):
        self._update_each(request, queryset.exclude(state=NodeState.MAINTENANCE), "put into maintenance",
                          maintenance=True)

    @admin.action(description="Unlist selected nodes (no new rentals)")
    def unlist(self, request, queryset):
        self._update_each(request, queryset.filter(listed=True), "unlisted", listed=False)

    @staticmethod
    def _update_each(request, nodes, done_text: str, **changes) -> None:
        """The provider's own service per node (its rules, not a second copy here); refusals named one by one."""
        done, refused = 0, []
        for node in nodes:
            try:
                node_update(node=node, **changes)
                done += 1
            except Conflict as exc:
                refused.append(f"{node.name}: {exc}")
        messages.info(request, f"{done} node(s) {done_text}.")
        for line in refused:
            messages.warning(request, line)

    @admin.action(description="Re-verify selected nodes")
    def reverify_nodes(self, request, queryset):
        done = 0
        for node in queryset:
            try:
                node_verify_request(node=node)
                done += 1
            except Conflict as exc:
                messages.warning(request, f"{node.name}: {exc}")
        messages.info(request, f"Verification queued for {done} node(s).")

    @admin.action(description="Accept the new SSH host key (quarantined nodes) and re-verify")
    def accept_new_host_key(self, request, queryset):
        for node in queryset:
            try:
                node_accept_host_key(node=node, operator_email=request.user.email)
            except Conflict as exc:  # the new key is another live node's: the same server twice
                messages.warning(request, f"{node.name}: {exc}")
        messages.info(request, "New host keys accepted for quarantined nodes; verification queued.")


@admin.register(Gpu)
class GpuAdmin(admin.ModelAdmin):
    list_display = ["__str__", "node", "index", "gpu_model", "memory_mib", "uuid", "status"]
    list_filter = ["status", "gpu_model"]
    search_fields = ["uuid", "node__name", "node__address"]
    list_select_related = ["node", "gpu_model"]
    readonly_fields = ["node", "index", "uuid", "gpu_model", "memory_mib", "pci_bus_id"]

    def get_readonly_fields(self, request, obj=None):
        # A split GPU leaves `mig` only through its node's check (provisioning.services.mig), under its row lock
        # and with none of its slices allocated: an operator's edit here would skip both.
        fields = list(super().get_readonly_fields(request, obj))
        return [*fields, "status"] if obj is not None and obj.status == GpuStatus.MIG else fields


@admin.register(MigSlice)
class MigSliceAdmin(admin.ModelAdmin):
    """The slices checks proved: operators see who holds which (the check alone writes them)."""

    list_display = ["__str__", "node", "gpu", "profile", "device", "uuid", "memory_mib", "status"]
    list_filter = ["status", "profile"]
    search_fields = ["uuid", "node__name", "node__address"]
    list_select_related = ["node", "gpu"]
    readonly_fields = ["node", "gpu", "profile", "device", "uuid", "memory_mib", "created_at"]


@admin.register(SshKey)
class SshKeyAdmin(admin.ModelAdmin):
    list_display = ["__str__", "user", "key_type", "fingerprint", "created_at"]
    search_fields = ["user__email", "name", "fingerprint"]
    list_select_related = ["user"]
    fields = ["user", "name", "public_key", "fingerprint", "created_at"]
    readonly_fields = fields  # type: ignore[assignment]  # names only here; django-stubs types `fields` as groups

    def has_add_permission(self, request):
        return False  # keys are added by their owners through the API, which parses them

    @admin.display(description="type")
    def key_type(self, key):
        return key.public_key.split(" ", 1)[0]


@admin.register(Image)
class ImageAdmin(admin.ModelAdmin):
    list_display = ["name", "slug", "docker_image", "libvirt_image", "min_disk_gb", "active"]
    list_filter = ["active"]
    search_fields = ["name", "slug", "docker_image", "libvirt_image"]
    prepopulated_fields = {"slug": ["name"]}


class GpuAllocationInline(admin.TabularInline):
    model = GpuAllocation
    fields = ["gpu", "gpu_index", "allocated_at", "released_at"]
    readonly_fields = fields  # type: ignore[assignment]  # names only here; django-stubs types `fields` as groups
    extra = 0
    can_delete = False
    ordering = ["-allocated_at", "gpu__index"]

    def has_add_permission(self, request, obj=None):
        return False

    @admin.display(description="index")
    def gpu_index(self, allocation):
        return allocation.gpu.index

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("gpu")


class InterruptionInline(admin.TabularInline):
    model = Interruption
    fields = ["cause", "detail", "started_at", "detected_at", "ended_at", "outcome", "credited_seconds", "credited"]
    readonly_fields = fields  # type: ignore[assignment]  # names only here; django-stubs types `fields` as groups
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False

    @admin.display(description="credited USD")
    def credited(self, interruption):
        return micros_to_usd(interruption.credited_micros)


@admin.register(Interruption)
class InterruptionAdmin(admin.ModelAdmin):
    """Every interruption of the fleet: which nodes lose renters' instances, and what it cost their providers."""

    list_display = ["id", "instance", "node", "cause", "started_at", "detected_at", "ended_at", "outcome", "credited"]
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
class InstanceAdmin(admin.ModelAdmin):
    list_display = ["id", "renter", "node", "gpu_model", "num_gpus", "image", "status", "price", "created_at",
                    "started_at"]
    list_filter = ["status", "node__runtime", "gpu_model", "image"]
    search_fields = ["=id", "renter__email", "node__name", "node__address", "label"]
    list_select_related = ["renter", "node", "gpu_model", "image"]
    date_hierarchy = "created_at"
    # Everything is read-only: state changes go through the actions, which call the services.
    # Of a renter's options, what operators need to follow an instance; never the registry password (only whether
    # one was given), nor the env's values (only their names).
    fields = ["renter", "node", "gpu_model", "num_gpus", "image", "image_ref", "registry_auth", "env_names",
              "ports_requested", "ports", "min_cuda_version", "os", "label", "disk_gb", "status", "status_message",
              "ssh_host", "ssh_port", "ssh_user", "ssh_public_keys", "price_per_gpu_hour_micros",
              "price_per_hour_micros", "idempotency_key", "request_fingerprint", "created_at", "started_at",
              "stopped_at", "destroyed_at", "updated_at"]
    readonly_fields = fields  # type: ignore[assignment]  # names only here; django-stubs types `fields` as groups
    inlines = [GpuAllocationInline, InterruptionInline]
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

    @admin.action(description="Stop selected running instances (keeps the disk, frees the GPUs)")
    def force_stop(self, request, queryset):
        self._apply(request, queryset, instance_stop, "stopping")

    @admin.action(description="Destroy selected instances (VM and disk)")
    def force_destroy(self, request, queryset):
        self._apply(request, queryset, instance_destroy, "destroying")


class AdminLoginForm(ThrottledLoginFormMixin, AdminAuthenticationForm):
    """The admin's log-in, behind the same lock-out as the API's and the pages' (marketplace/auth.py). An account
    with two-factor log-in logs in on the site's page, which asks for the code, and comes back."""

    def confirm_login_allowed(self, user):
        super().confirm_login_allowed(user)
        if two_factor_enabled(user=user):
            raise ValidationError(
                "This account uses two-factor log-in: log in on the site's log-in page "
                "(/accounts/login/?next=/admin/), which asks for the code, then come back here.", code="two_factor")


admin.site.login_form = AdminLoginForm

# django-otp's own admin pages would show the TOTP secrets and the recovery codes (their tables are empty since the
# project's encrypted devices replaced them, marketplace/models/two_factor.py), and operators never see a secret:
# for a user who lost both the phone and the codes, the users' list has an action that turns two-factor off.
for _otp_model in (TOTPDevice, StaticDevice):
    if admin.site.is_registered(_otp_model):
        admin.site.unregister(_otp_model)

@admin.register(Volume)
class VolumeAdmin(admin.ModelAdmin):
    """Renters' volumes, read-only: they are created, mounted and deleted through the API and the pages (the
    deletion needs the owner's confirmation), and billed by billing.services.storage."""

    list_display = ["name", "owner", "node", "size_gb", "state", "price_per_gb_month_micros", "cost_micros",
                    "created_at"]
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
