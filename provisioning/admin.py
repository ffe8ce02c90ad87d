"""Operators' view of jobs, node events and verification runs; the node page's latest of them (shown by
marketplace.admin.NodeAdmin, whose actions call provisioning's services)."""
from datetime import timedelta

from django.contrib import admin
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from core.admin_history import History
from core.admin_paginator import EstimatedCountPaginator
from core.admin_search import KeySearchAdmin
from marketplace.stored_figures import run_figures, run_findings
from provisioning.models import OPEN_JOB_STATUSES, Job, NodeEvent, VerificationRun
from provisioning.services.runner import log_lines
from provisioning.verification.platform_figures import platform_checks
from provisioning.verification.wording import reasons, reasons_text


def findings_list(findings) -> str:
    """A verification run's findings as a readable list, each said once with the GPUs it concerns: severity,
    message, code (no style attribute: the Content-Security-Policy refuses inline styles). Stored JSON of any
    shape: only the findings stored_figures.run_findings reads (an object with a text code and message) are shown."""
    findings = run_findings(findings)
    if not findings:
        return "-"
    return format_html("<ul class=\"findings\">{}</ul>", format_html_join(
        "", "<li><strong>{}</strong> {} <code>{}</code></li>",
        ((r.severity, r.text, r.code) for r in reasons(findings))))


def _value(value, unit="", places=2) -> str:
    return "-" if value is None else f"{value:,.{places}f}{unit}"


def platform_checks_table(figures) -> str:
    """What the platform measured itself in a run (platform_figures.platform_checks) as a table: per GPU and MIG
    slice the challenge on the platform's clock and the memory proof; '-' for a run without the challenge. Stored
    JSON of any shape: read as stored_figures.run_figures reads it (a value of the wrong kind left out)."""
    checks = platform_checks(run_figures(figures))
    if checks is None:
        return "-"
    answered = {None: "no answer", True: "right", False: "WRONG"}
    rows = format_html_join("", "<tr><th>{}</th><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>", (
        (g.device, _value(g.challenge_tflops, places=1), _value(g.challenge_share and g.challenge_share * 100, " %", 0),
         answered[g.challenge_correct], _value(g.memory_s, " s", 3),
         g.memory_held or ("not run" if checks.memory_not_run else "no answer")) for g in checks.gpus))
    note = (f"Memory proof not run: {checks.memory_not_run}" if checks.memory_not_run else
            f"Memory proof: {_value(checks.memory_gib, ' GiB', 1)} per GPU, re-read due within "
            f"{_value(checks.memory_deadline_s, ' s', 3)}")
    return format_html("<table><thead><tr><th>GPU</th><th>challenge BF16 TFLOP/s (platform's clock)</th>"
                       "<th>of datasheet</th><th>products</th><th>memory re-read</th><th>memory held</th></tr>"
                       "</thead><tbody>{}</tbody></table><p>{}</p>", rows, note)


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


class WithinFilter(admin.SimpleListFilter):
    """Rows of the last 24 hours or 7 days by one of their times (`field`): the dashboard's "in 24 h" and "in 7 days"
    counts link here, so that their lists show the window counted, not every row ever made (review r54)."""
    title = ""
    parameter_name = ""
    field = ""
    WINDOWS = {"24h": timedelta(days=1), "7d": timedelta(days=7)}

    def lookups(self, request, model_admin):
        return [("24h", "in the last 24 hours"), ("7d", "in the last 7 days")]

    def queryset(self, request, queryset):
        window = self.WINDOWS.get(self.value() or "")
        if window is None:
            return queryset
        return queryset.filter(**{f"{self.field}__gte": timezone.now() - window})


class FinishedWithinFilter(WithinFilter):
    title = "finished"
    parameter_name = "finished"
    field = "finished_at"


class CreatedWithinFilter(WithinFilter):
    title = "made"
    parameter_name = "made"
    field = "created_at"


class ReadOnlyAdmin(KeySearchAdmin):
    """Jobs, node events and verification runs: rows that grow with the fleet's life, read newest first by the
    primary key's index (their models' -created_at has none, and every page sorted the whole table), no COUNT(*) of
    every row per page (an estimate when unfiltered and large) and no second "N total" count
    (core/admin_paginator.py; found by review), as the usage intervals' and the notifications' lists. A job's id
    searched by its index (core/admin_search.py)."""

    ordering = ["-id"]
    paginator = EstimatedCountPaginator
    show_full_result_count = False

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Job)
class JobAdmin(ReadOnlyAdmin):
    list_display = ["id", "kind", "node", "instance", "status", "fault", "step", "attempts", "created_at",
                    "finished_at", "deadline"]
    # fault: whose failure a failed job is; only the node's count against its reliability (the platform's are
    # the platform's own trouble to look into).
    list_filter = [StuckFilter, FinishedWithinFilter, "status", "fault", "kind", "created_at"]
    search_fields = ["=id", "node__name", "node__address", "error"]
    list_select_related = ["node", "instance"]
    readonly_fields = ["kind", "node", "instance", "status", "fault", "step", "attempts", "error", "log_lines",
                       "created_at", "started_at", "finished_at", "deadline", "sent_at", "send_attempts", "send_error",
                       "runner", "heartbeat_at", "lost_runs"]
    exclude = ["log"]

    @admin.display(description="log")
    def log_lines(self, job):
        return format_html_join("\n", "<div><code>{}</code> {}</div>",
                                ((line.get("at") or "", line.get("message", "")) for line in log_lines(job.log)))


@admin.register(NodeEvent)
class NodeEventAdmin(ReadOnlyAdmin):
    list_display = ["created_at", "node", "level", "kind", "message"]
    list_filter = ["level", "kind", "created_at"]
    search_fields = ["node__name", "message"]
    list_select_related = ["node"]


@admin.register(VerificationRun)
class VerificationRunAdmin(ReadOnlyAdmin):
    list_display = ["created_at", "node", "verdict", "score", "reason_summary"]
    list_filter = ["verdict", CreatedWithinFilter, "created_at"]
    search_fields = ["node__name"]
    list_select_related = ["node"]
    readonly_fields = ["node", "job", "verdict", "score", "reasons", "platform_measured", "created_at", "inventory",
                       "figures"]
    exclude = ["findings"]

    @admin.display(description="what the platform measured itself")
    def platform_measured(self, run):
        return platform_checks_table(run.figures)

    @admin.display(description="reasons")
    def reason_summary(self, run):
        return reasons_text(run_findings(run.findings))[:300] or "-"

    @admin.display(description="reasons (findings)")
    def reasons(self, run):
        return findings_list(run.findings)


# A node's history on its page (marketplace.admin.NodeAdmin): the latest rows, and a link to all of them.
node_events = History(NodeEvent, "node", ["created_at", "level", "kind", "message"], title="Events")
node_verification_runs = History(
    VerificationRun, "node",
    ["created_at", "verdict", "score", ("reasons", lambda run: findings_list(run.findings))],
    title="Verification runs")
