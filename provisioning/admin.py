"""Operators' view of jobs, node events and verification runs, plus node actions."""
from django.contrib import admin, messages
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from provisioning.models import OPEN_JOB_STATUSES, Job, NodeEvent, VerificationRun


def findings_list(findings) -> str:
    """A verification run's findings as a readable list: severity, GPU, message, code (no style attribute: the
    Content-Security-Policy refuses inline styles)."""
    if not findings:
        return "-"
    return format_html("<ul class=\"findings\">{}</ul>", format_html_join(
        "", "<li><strong>{}</strong> {}{} <code>{}</code></li>",
        ((f.get("severity", ""), f"GPU {f['gpu_index']}: " if f.get("gpu_index") is not None else "",
          f.get("message", ""), f.get("code", "")) for f in findings)))


class StuckFilter(admin.SimpleListFilter):
    """Jobs still open after their deadline: the reaper should have failed them."""

    title = "stuck"
    parameter_name = "stuck"

    def lookups(self, request, model_admin):
        return [("yes", "Open past deadline")]

    def queryset(self, request, queryset):
        if self.value() == "yes":
            return queryset.filter(status__in=OPEN_JOB_STATUSES, deadline__lt=timezone.now())
        return queryset


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Job)
class JobAdmin(ReadOnlyAdmin):
    list_display = ["id", "kind", "node", "instance", "status", "step", "attempts", "created_at", "finished_at",
                    "deadline"]
    list_filter = [StuckFilter, "status", "kind", "created_at"]
    search_fields = ["=id", "node__name", "node__address", "error"]
    list_select_related = ["node", "instance"]
    readonly_fields = ["kind", "node", "instance", "status", "step", "attempts", "error", "log_lines", "created_at",
                       "started_at", "finished_at", "deadline", "sent_at", "send_attempts", "send_error", "runner",
                       "heartbeat_at", "lost_runs"]
    exclude = ["log"]

    @admin.display(description="log")
    def log_lines(self, job):
        return format_html_join("\n", "<div><code>{}</code> {}</div>",
                                ((line.get("at", ""), line.get("message", "")) for line in job.log))


@admin.register(NodeEvent)
class NodeEventAdmin(ReadOnlyAdmin):
    list_display = ["created_at", "node", "level", "kind", "message"]
    list_filter = ["level", "kind", "created_at"]
    search_fields = ["node__name", "message"]
    list_select_related = ["node"]


@admin.register(VerificationRun)
class VerificationRunAdmin(ReadOnlyAdmin):
    list_display = ["created_at", "node", "verdict", "score", "reason_summary"]
    list_filter = ["verdict", "created_at"]
    search_fields = ["node__name"]
    list_select_related = ["node"]
    readonly_fields = ["node", "job", "verdict", "score", "reasons", "created_at", "inventory", "figures"]
    exclude = ["findings"]

    @admin.display(description="reasons")
    def reason_summary(self, run):
        return "; ".join(f.get("message", "") for f in run.findings)[:300] or "-"

    @admin.display(description="reasons (findings)")
    def reasons(self, run):
        return findings_list(run.findings)


def reverify_nodes(modeladmin, request, queryset):
    from marketplace.services.nodes import NodeConflict
    from provisioning.services.verification import node_verify_request

    done = 0
    for node in queryset:
        try:
            node_verify_request(node=node)
            done += 1
        except NodeConflict as exc:
            messages.warning(request, f"{node.name}: {exc}")
    messages.info(request, f"Verification queued for {done} node(s).")


reverify_nodes.short_description = "Re-verify selected nodes"


def accept_new_host_key(modeladmin, request, queryset):
    from marketplace.services.nodes import NodeConflict
    from provisioning.services.nodes import node_accept_host_key

    for node in queryset:
        try:
            node_accept_host_key(node=node, operator_email=request.user.email)
        except NodeConflict as exc:  # the new key is another live node's: the same server twice
            messages.warning(request, f"{node.name}: {exc}")
    messages.info(request, "New host keys accepted for quarantined nodes; verification queued.")


accept_new_host_key.short_description = "Accept the new SSH host key (quarantined nodes) and re-verify"


class NodeEventInline(admin.TabularInline):
    model = NodeEvent
    fields = ["created_at", "level", "kind", "message"]
    readonly_fields = fields
    extra = 0
    max_num = 0
    can_delete = False
    ordering = ["-created_at"]


class VerificationRunInline(admin.TabularInline):
    model = VerificationRun
    fields = ["created_at", "verdict", "score", "reasons"]
    readonly_fields = fields
    extra = 0
    max_num = 0
    can_delete = False
    ordering = ["-created_at"]

    @admin.display(description="reasons")
    def reasons(self, run):
        return findings_list(run.findings)


# provisioning extends the marketplace's node admin (marketplace knows nothing of provisioning).
from marketplace.admin import NodeAdmin  # noqa: E402

NodeAdmin.actions = [*NodeAdmin.actions, reverify_nodes, accept_new_host_key]
NodeAdmin.inlines = [*NodeAdmin.inlines, VerificationRunInline, NodeEventInline]
