"""The operators' panel for the catalogue and the fleet: GPU models, nodes (re-verify, accept a new host key,
maintenance), their GPUs and MIG slices."""
from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ActionForm
from django.core.exceptions import ValidationError
from django.db import connections, router, transaction
from django.db.models import Q

from core.admin_history import HistoryAdmin
from core.errors import ApplicationError, Conflict
from marketplace.admin.common import (
    STAFF_ACCOUNT_REFUSED,
    NothingEditableAdmin,
    refuse_stale_value,
    staff_of_a_non_superuser,
    to_write,
)
from marketplace.models import (
    Gpu,
    GpuModel,
    GpuStatus,
    MigSlice,
    Node,
    NodeState,
)
from marketplace.models.nodes import offerable
from marketplace.money import micros_to_usd
from marketplace.selectors import free_gpu_count
from marketplace.services.account_status import REASON_MAX_LENGTH, status_reason_clean
from marketplace.services.nodes import OPERATOR_NODE_ACTIONS, node_change_by_operator
from provisioning.admin import node_events, node_verification_runs
from provisioning.services.verification import node_accept_host_key, node_verify_request


@admin.register(GpuModel)
class GpuModelAdmin(admin.ModelAdmin):
    list_display = ["name", "smi_name", "architecture", "memory_gb", "memory_type", "memory_bandwidth_gbps",
                    "fp32_tflops", "tf32_tflops", "bf16_tflops", "tdp_w", "pcie_gen", "mig_max_instances"]
    list_filter = ["architecture", "form_factor", "memory_type"]
    search_fields = ["name", "smi_name", "slug"]

    # A model's row is catalogue data: marketplace/data/gpu_models.json, loaded by the migrations
    # (marketplace.catalogue_data, which a later catalogue migration runs again, by slug, over every field), and read
    # as it stands by gpu-selfcheck and the benches. The checks judge nodes against it (DeclaredModel.from_gpu_model:
    # the nvidia-smi name, memory sizes, lanes and PCIe generation, the datasheet figures, the tensor cores and
    # MIG), and the slug keys the PCI device ids, the MIG profiles and the API's filters: renamed here, the PCI id
    # check said nothing for that model's nodes and every MIG check failed on a profile it no longer found (found by
    # review). So a model is added here, with its slug, and read-only once saved; it changes through the data file
    # and a migration, like every other row of the catalogue.
    CATALOGUE_FIELDS = [f.name for f in GpuModel._meta.concrete_fields if not f.primary_key]

    def get_readonly_fields(self, request, obj=None):
        fields = list(super().get_readonly_fields(request, obj))
        return [*fields, *(f for f in self.CATALOGUE_FIELDS if f not in fields)] if obj is not None else fields

    def save_model(self, request, obj, form, change):
        if not change:  # a saved model has nothing editable: its row is not written again
            super().save_model(request, obj, form, change)

    def has_delete_permission(self, request, obj=None):
        # Nor deleted here, one by one or with delete_selected over the list (which emptied every unused row of the
        # catalogue; review r53): providers could no longer register that model and the API's filters lost it
        # until a later catalogue migration made it again. It leaves the catalogue through the data file too.
        return False


class GpuStatusForm(forms.ModelForm):
    """An operator takes a free GPU out of service or puts it back, nothing else: `rented` is set by a booking,
    `mig` by its node's check proving slices on it (provisioning.services.mig); set by hand, a GPU would be rented
    to nobody or split into no slice, and never booked whole again. Other statuses are shown, not editable.

    The page sends back the status it showed (a hidden initial), and a GPU counts as changed when the operator
    changed that, not when the row moved since: compared with the row as read at the save, a GPU a health check found
    missing after the page opened (unavailable, lost_at set: provisioning.services.gpu_presence) was written back
    free and no longer lost by a save of another GPU of the node's page, or a Save of its own page that changed
    nothing, and was offered and booked again (found by review). A GPU whose status moved since the page showed it
    is refused on the form (marketplace.admin.common.refuse_stale_value), nothing of the page saved, unless the
    page's value agrees with the new one (nothing to write); one left as shown is not written."""

    EDITABLE = (GpuStatus.FREE, GpuStatus.UNAVAILABLE)

    class Meta:
        model = Gpu
        fields = ["status"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        field = self.fields.get("status")
        if field is None:
            return
        if self.instance.pk is not None and self.instance.status not in self.EDITABLE:
            field.disabled = True  # the posted value is ignored; the stored one stays
        else:
            field.choices = [(value, label) for value, label in GpuStatus.choices if value in self.EDITABLE]
            field.show_hidden_initial = True

    def clean(self):
        cleaned = super().clean()
        if refuse_stale_value(self, "status", self._now):
            return cleaned
        if to_write(self, "status"):
            # The operator's decision takes over from a loss's: a lost GPU freed by hand is no longer lost (the
            # next health check judges it again if it is still missing).
            self.instance.lost_at = None
        return cleaned

    def _now(self, stored: str) -> str:
        lost_at = self.instance.lost_at  # as read when the form was sent (the form has no such field)
        lost = f", lost (no longer listed by its server) since {lost_at:%Y-%m-%d %H:%M} UTC" if lost_at else ""
        return f"“{stored}”{lost}"

    def changed_columns(self) -> list[str]:
        """What the operator changed (from the page's status to one the row does not hold), and what the status rule
        sets with it (clean): nothing when nothing changed."""
        return ["status", "lost_at"] if to_write(self, "status") else []

    def save(self, commit=True):
        """Only the changed columns are written (changed_columns). The row was read locked (GpuAdmin.get_object,
        GpuInline.get_queryset): a whole-row save wrote back the status it had read, a GPU rented meanwhile went
        back to free under its instance, or one released meanwhile stayed rented to nobody (found by review)."""
        if not commit or self.instance.pk is None:
            return super().save(commit=commit)
        if self.errors:
            return super().save(commit=commit)  # Django's ValueError
        columns = self.changed_columns()
        if columns:
            self.instance.save(update_fields=columns)
        self._save_m2m()
        return self.instance


def _locks(request, queryset) -> bool:
    """A form is sent in a transaction: the change form's (the admin's form and save share one). Django calls
    get_object from views outside one too (the history page, which also answers a POST): a lock there was a
    TransactionManagementError, a 500 (found by review)."""
    return request.method == "POST" and connections[queryset.db].in_atomic_block


def _locked_for_a_post(request, queryset):
    """The rows a form will write, read under their lock when it is sent: nothing moves them between the form's
    read, its checks (Gpu.clean) and its save. Only those rows (`of` self): not the rows joined to show them."""
    return queryset.select_for_update(of=("self",)) if _locks(request, queryset) else queryset


def _gpu_of_a_staff_account(request, node) -> bool:
    """A staff account's or a superuser's node: its GPUs are a superuser's to change, as the node's actions are
    (NodeAdmin._allowed; common.staff_of_a_non_superuser). Before, a non-superuser with change_gpu set every GPU of
    a superuser's node unavailable, on the GPU's page or the node's, and so took it off the offers as the unlist
    they are refused would (found by review)."""
    return node is not None and staff_of_a_non_superuser(request.user, node.provider)


class GpuInline(admin.TabularInline):
    model = Gpu
    form = GpuStatusForm
    fields = ["index", "uuid", "gpu_model", "memory_mib", "pci_bus_id", "status", "lost_at"]
    readonly_fields = ["index", "uuid", "gpu_model", "memory_mib", "pci_bus_id", "lost_at"]
    extra = 0
    can_delete = False

    # As on the GPUs' own admin (GpuAdmin): a node's inventory makes its GPUs, and a GPU is taken out of service,
    # never deleted. The inline's own rule was the model's add permission: a superuser's node page offered "Add
    # another GPU", a row whose form carries only the status, and saving it was a 500 (no index; found by review).
    def has_add_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    # `obj` is the node whose page it is: a staff account's node shows its GPUs read-only to other staff.
    def has_change_permission(self, request, obj=None):
        return super().has_change_permission(request, obj) and not _gpu_of_a_staff_account(request, obj)

    def get_queryset(self, request):
        # Each row's model read with it (its read-only column): one query for the rows, not one more per GPU.
        return _locked_for_a_post(request, super().get_queryset(request).select_related("gpu_model"))


class NodeActionForm(ActionForm):
    """The list's actions bar, with the reason the retire, unlist and maintenance actions tell the providers."""

    reason = forms.CharField(
        label="Reason:", required=False, max_length=REASON_MAX_LENGTH,
        help_text="Retire, unlist, maintenance: told to the node's provider (e-mail, webhooks, their list) and kept "
                  "in the node's events.")


class RetiredFilter(admin.SimpleListFilter):
    """Retired nodes apart from the others: the dashboard counts rejected (and degraded) nodes that are not retired,
    and links here with retired=no, so its count and its list agree (review r54)."""
    title = "retired"
    parameter_name = "retired"

    def lookups(self, request, model_admin):
        return [("yes", "retired"), ("no", "not retired")]

    def queryset(self, request, queryset):
        if self.value() == "yes":
            return queryset.filter(state=NodeState.RETIRED)
        if self.value() == "no":
            return queryset.exclude(state=NodeState.RETIRED)
        return queryset


@admin.register(Node)
class NodeAdmin(NothingEditableAdmin, HistoryAdmin):
    list_display = ["name", "provider", "gpu_model", "gpu_count", "gpus_free", "price", "country", "city", "state",
                    "verdict", "listed", "score", "reliability", "state_changed_at"]
    list_filter = ["state", RetiredFilter, "verdict", "listed", "runtime", "gpu_model", "country"]
    search_fields = ["name", "address", "provider__email", "city", "datacenter", "host_key_fingerprint"]
    list_select_related = ["provider", "gpu_model"]
    # ssh_private_key_encrypted is excluded: nobody reads a private key through the admin.
    fields = ["provider", "name", "address", "ssh_port", "ssh_user", "host_key_fingerprint", "country", "city",
              "datacenter", "gpu_model", "gpu_count", "price_per_gpu_hour_micros", "runtime", "state",
              "state_changed_at", "verdict", "listed", "score", "reliability", "last_error", "next_check_at",
              "next_spot_check_at", "ssh_public_key", "created_at", "updated_at"]
    # All read-only (the next checks' times: drawn at random, never shown to providers): the page saves its GPUs'
    # rows (the inline), never the node's (NothingEditableAdmin). What a provider sets (name,
    # place, price, listed) changes only through node_update, whose rules a form here skipped (it relisted a
    # retired node): operators unlist and put into maintenance with the actions below, which call it.
    readonly_fields = fields  # type: ignore[assignment]  # names only here; django-stubs types `fields` as groups
    inlines = [GpuInline]
    # The latest runs and events, and links to all of them: inlines showed every one the node ever had.
    latest_runs, latest_events = node_verification_runs, node_events
    histories = ["latest_runs", "latest_events"]
    actions = ["set_maintenance", "unlist", "reverify_nodes", "accept_new_host_key", "retire"]
    action_form = NodeActionForm

    def has_add_permission(self, request):
        return False  # nodes are registered by providers, which creates their key pair

    def has_delete_permission(self, request, obj=None):
        # Retire instead (the action below): a delete took the node's checks, events and jobs with it, under a job
        # that may be running, and nodes that ever rented are protected anyway by their instances and volumes.
        return False

    def get_formset_kwargs(self, request, obj, inline, prefix):
        """The node's GPU rows locked first, in one step in id order (the order the release of MIG slices takes
        them in: instances.mig._lock_parents_shared), not in the inline's (node, index), which is another order once
        an inventory has numbered the cards anew. The inline's read then finds them locked by this transaction."""
        if isinstance(inline, GpuInline) and obj is not None:
            gpus = Gpu.objects.filter(node=obj).order_by("pk")
            if _locks(request, gpus):
                list(gpus.select_for_update().values_list("pk", flat=True))
        return super().get_formset_kwargs(request, obj, inline, prefix)

    def get_queryset(self, request):
        # The offers' own count (a subquery: the list's counts of nodes leave it out, the rows shown run it).
        return super().get_queryset(request).annotate(_free=free_gpu_count())

    @admin.display(ordering="_free", description="free GPUs")
    def gpus_free(self, node):
        return node._free

    @admin.display(ordering="price_per_gpu_hour_micros", description="USD/GPU-h")
    def price(self, node):
        return micros_to_usd(node.price_per_gpu_hour_micros)

    @staticmethod
    def _allowed(request, nodes) -> list[Node]:
        """The selected nodes the operator may change: a staff account's are a superuser's to change (the users'
        rule, common.staff_of_a_non_superuser; before, any staff account with change_node retired a superuser's
        servers, found by review). The others are named, left as they are."""
        allowed: list[Node] = []
        refused: list[Node] = []
        for node in nodes.select_related("provider"):
            (refused if staff_of_a_non_superuser(request.user, node.provider) else allowed).append(node)
        if refused:
            messages.error(request, f"Left as they are: {', '.join(node.name for node in refused)}: "
                                    f"{STAFF_ACCOUNT_REFUSED}.")
        return allowed

    @admin.action(description="Put selected nodes into maintenance (with the reason above, told to the provider)",
                  permissions=["change"])
    def set_maintenance(self, request, queryset):
        self._by_operator(request, queryset.exclude(state=NodeState.MAINTENANCE), "maintenance")

    @admin.action(description="Unlist selected nodes (no new rentals; with the reason above, told to the provider)",
                  permissions=["change"])
    def unlist(self, request, queryset):
        self._by_operator(request, queryset.filter(listed=True), "unlist")

    def _by_operator(self, request, nodes, action: str) -> None:
        """The provider's own services per node (node_change_by_operator: their rules, not a second copy here), the
        node's event and the provider told with the reason; refusals named one by one. Each node changed is
        recorded in the admin's log with the operator (LogEntry), a refused one not."""
        try:
            reason = status_reason_clean(request.POST.get("reason", ""))
        except ApplicationError as exc:
            messages.error(request, f"Nothing done: {exc}")
            return
        done_text = OPERATOR_NODE_ACTIONS[action][1]
        done, refused = 0, []
        for node in self._allowed(request, nodes):
            try:
                if node_change_by_operator(node=node, action=action, by=request.user, reason=reason):
                    done += 1
                    self.log_change(request, node, f"{done_text.capitalize()}" + (f": {reason}" if reason else "")
                                    + ".")
            except Conflict as exc:
                refused.append(f"{node.name}: {exc}")
        messages.info(request, f"{done} node(s) {done_text}.")
        for line in refused:
            messages.warning(request, line)

    @admin.action(description="Re-verify selected nodes", permissions=["change"])
    def reverify_nodes(self, request, queryset):
        done = 0
        for node in self._allowed(request, queryset):
            try:
                node_verify_request(node=node)
                done += 1
                self.log_change(request, node, "Re-verification asked.")
            except Conflict as exc:
                messages.warning(request, f"{node.name}: {exc}")
        messages.info(request, f"Verification queued for {done} node(s).")

    @admin.action(description="Retire selected nodes (for good: never checked or booked again; with the reason "
                              "above, told to the provider)", permissions=["change"])
    def retire(self, request, queryset):
        """The provider's own retire (node_retire): refused, with what stands in the way, while renters' instances
        or volumes are on the node."""
        self._by_operator(request, queryset.exclude(state=NodeState.RETIRED), "retire")

    @admin.action(description="Accept the new SSH host key (quarantined nodes) and re-verify", permissions=["change"])
    def accept_new_host_key(self, request, queryset):
        """Says what was done: the nodes whose new key was accepted (each recorded in the admin's log with the
        operator, as the other node actions), those left as they are with no new key waiting, those refused. It
        said "New host keys accepted" whatever happened, also when no node was quarantined (found by review)."""
        accepted, left = [], []
        for node in self._allowed(request, queryset):
            try:
                fingerprint = self._accepted_host_key(request, node)
            except Conflict as exc:  # the new key is another live node's: the same server twice
                messages.warning(request, f"{node.name}: {exc}")
                continue
            if fingerprint is None:
                left.append(node.name)
            else:
                accepted.append(node.name)
                self.log_change(request, node, f"Accepted new host key {fingerprint}; re-verification asked.")
        if accepted:
            messages.info(request, f"New host key accepted and verification queued for {len(accepted)} node(s): "
                                   f"{', '.join(accepted)}.")
        else:
            messages.info(request, "No new host key accepted.")
        if left:
            messages.warning(request, f"Left as they are, not quarantined with a new host key waiting: "
                                      f"{', '.join(left)}.")


    @staticmethod
    def _accepted_host_key(request, node) -> str | None:
        """The node's service (node_accept_host_key), and the key it pinned: the one waiting when the node's row
        was locked, now pinned; None when it pinned none (not quarantined, no new key: it leaves such a node as it
        is). The row stays locked from the read to the answer: nothing else pins or quarantines it between."""
        with transaction.atomic(using=router.db_for_write(Node)):
            nodes = Node.objects.select_for_update(no_key=True).filter(pk=node.pk)
            waiting = nodes.values_list("seen_host_key_fingerprint", flat=True).first()
            node_accept_host_key(node=node, operator_email=request.user.email)
            pinned = Node.objects.filter(pk=node.pk).values_list("host_key_fingerprint", flat=True).first()
        return pinned if waiting and pinned == waiting else None


class BookableFilter(admin.SimpleListFilter):
    """The GPUs renters can book now: free, on a node the offers list (marketplace.models.nodes.offerable). What the
    dashboard's "GPUs free to book" counts, and links here with bookable=yes: it linked to status=free, which lists
    the free GPUs of offline, rejected, pending, unlisted and retired nodes too (review r54)."""
    title = "bookable"
    parameter_name = "bookable"

    def lookups(self, request, model_admin):
        return [("yes", "free, on a node renters can book"), ("no", "not bookable now")]

    def queryset(self, request, queryset):
        bookable = Q(status=GpuStatus.FREE, node_id__in=Node.objects.filter(offerable()).values("pk"))
        if self.value() == "yes":
            return queryset.filter(bookable)
        if self.value() == "no":
            return queryset.exclude(bookable)
        return queryset


@admin.register(Gpu)
class GpuAdmin(admin.ModelAdmin):
    list_display = ["__str__", "node", "index", "gpu_model", "memory_mib", "uuid", "status"]
    list_filter = [BookableFilter, "status", "gpu_model"]
    search_fields = ["uuid", "node__name", "node__address"]
    list_select_related = ["node", "gpu_model"]
    readonly_fields = ["node", "index", "uuid", "gpu_model", "memory_mib", "pci_bus_id"]
    form = GpuStatusForm

    def has_add_permission(self, request):
        return False  # a node's inventory creates its GPUs (a GPU added here was a 500: no node, no index)

    def has_delete_permission(self, request, obj=None):
        # The node's gpu_count says how many it has, its allocations and slices hang on each: a node is retired,
        # a GPU taken out of service (status unavailable), never deleted.
        return False

    def has_change_permission(self, request, obj=None):
        return (super().has_change_permission(request, obj)
                and not (obj is not None and _gpu_of_a_staff_account(request, obj.node)))

    def get_object(self, request, object_id, from_field=None):
        # Locked when the form is sent (_locked_for_a_post: in the change form's transaction, not on the history
        # page); Django's get_object, with that queryset.
        queryset = _locked_for_a_post(request, self.get_queryset(request))
        field = self.model._meta.pk if from_field is None else self.model._meta.get_field(from_field)
        try:
            return queryset.get(**{field.name: field.to_python(object_id)})
        except (self.model.DoesNotExist, ValidationError, ValueError):
            return None

    def save_model(self, request, obj, form, change):
        if change:
            columns = form.changed_columns()
            if columns:
                obj.save(update_fields=columns)
        else:
            super().save_model(request, obj, form, change)

    def get_readonly_fields(self, request, obj=None):
        # A split GPU leaves `mig` only through its node's check (provisioning.services.mig), under its row lock
        # and with none of its slices allocated: an operator's edit here would skip both.
        fields = list(super().get_readonly_fields(request, obj))
        return [*fields, "status"] if obj is not None and obj.status == GpuStatus.MIG else fields


@admin.register(MigSlice)
class MigSliceAdmin(NothingEditableAdmin, admin.ModelAdmin):
    """The slices checks proved: operators see who holds which (the check alone writes them).

    The status too: `rented` is a booking's, `free` and `unavailable` its node's check's, which sets every proven
    slice free again at its next run (provisioning.services.mig); set here, a slice was rented to nobody. An operator
    takes a node out with its maintenance action."""

    list_display = ["__str__", "node", "gpu", "profile", "device", "uuid", "memory_mib", "status"]
    list_filter = ["status", "profile"]
    search_fields = ["uuid", "node__name", "node__address"]
    list_select_related = ["node", "gpu"]
    fields = ["node", "gpu", "profile", "device", "uuid", "memory_mib", "status", "created_at"]
    readonly_fields = fields  # type: ignore[assignment]  # names only here; django-stubs types `fields` as groups

    def has_add_permission(self, request):
        return False  # a check creates slices (one added here was a 500: no device, no GPU)

    def has_delete_permission(self, request, obj=None):
        return False  # a check marks a slice gone unavailable; its allocations keep pointing at it
