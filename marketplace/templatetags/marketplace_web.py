"""Template helpers of the web pages: money, badges, form fields (the navigation is marketplace/web/nav.py)."""
from decimal import Decimal

from django import forms, template
from django.utils.html import format_html

from core.money import micros_to_usd, usd_rate_text, usd_text, usd_text_up
from marketplace.models.host import cuda_version_text

register = template.Library()

_BADGES = {
    # node states
    "active": "ok", "verifying": "info", "pending": "neutral", "rejected": "bad", "maintenance": "warn",
    "offline": "bad", "quarantined": "bad", "retired": "neutral",
    # verdicts
    "verified": "ok", "degraded": "warn", "unverified": "neutral",
    # instance statuses
    "requested": "info", "provisioning": "info", "running": "ok", "stopping": "info", "stopped": "neutral",
    "starting": "info", "destroying": "info", "destroyed": "neutral", "failed": "bad", "interrupted": "bad",
    # jobs, GPUs, findings
    "queued": "info", "succeeded": "ok", "free": "ok", "rented": "info", "unavailable": "neutral",
    "reject": "bad", "degrade": "warn",
}


@register.filter
def usd(micros) -> str:
    """An amount (a balance, a total, a charge) as a person reads it: whole cents, one minus sign ("$1.39",
    "−$5.00"); "–" for none. Prices per unit: `usd_rate`.

    The same words as core.money.usd_text (messages, e-mails, errors): one rule for every page and sentence.
    """
    if micros is None or micros == "":
        return "–"
    return usd_text(int(micros))


@register.filter
def usd_up(micros) -> str:
    """An amount the renter must reach (what an hour needs, a shortfall to top up), rounded UP to the cent
    (core.money.usd_text_up): topping up what it says is always enough. "–" for none."""
    if micros is None or micros == "":
        return "–"
    return usd_text_up(int(micros))


@register.filter
def usd_rate(micros) -> str:
    """A price per unit (per GPU-hour, per hour, per GB-month) with its significant decimals, at least two
    ("$1.504", "$1.50"): the exact price that is charged and filtered on, never rounded to cents
    (core.money.usd_rate_text); "–" for none. Totals and balances: `usd`."""
    if micros is None or micros == "":
        return "–"
    return usd_rate_text(int(micros))


@register.filter
def usd_decimal(micros) -> Decimal:
    """Micro-dollars as a plain decimal for a form field (1.39, not 1.390000)."""
    value = micros_to_usd(int(micros)).normalize()
    return value.quantize(Decimal("0.01")) if value == value.quantize(Decimal("0.01")) else value


@register.filter
def badge(value, label=None):
    """A coloured pill for a state, verdict or status; the words carry the meaning, not the colour."""
    value = str(value or "")
    return format_html('<span class="badge {}">{}</span>', _BADGES.get(value, "neutral"), label or value)


@register.filter
def tone(value) -> str:
    """The badge's colour class of a state ("ok", "warn", "bad", "info", "neutral"), for styling a whole panel."""
    return _BADGES.get(str(value or ""), "neutral")


@register.filter
def percent(value, places=0) -> str:
    if value is None:
        return "–"
    return f"{float(value) * 100:.{int(places)}f} %"


@register.filter
def cuda(code) -> str:
    """A CUDA version stored as major*1000 + minor*10 (marketplace.models.host) as people write it: "12.2"."""
    return cuda_version_text(code) or "–"


@register.filter
def number(value, places=1) -> str:
    if value is None or value == "":
        return "–"
    return f"{float(value):,.{int(places)}f}"


@register.inclusion_tag("marketplace/includes/field.html")
def field(bound_field, css_class=""):
    """One form field with its label, help and errors tied to it (aria-describedby, aria-invalid)."""
    widget = bound_field.field.widget
    kind = "checkbox" if isinstance(widget, forms.CheckboxInput) else (
        "choices" if isinstance(widget, forms.RadioSelect | forms.CheckboxSelectMultiple) else "input")
    described = []
    if bound_field.help_text:
        described.append(f"{bound_field.auto_id}_helptext")
    if bound_field.errors:
        described.append(f"{bound_field.auto_id}_errors")
    attrs = {}
    if described:
        attrs["aria-describedby"] = " ".join(described)
    if bound_field.errors:
        attrs["aria-invalid"] = "true"
        # The form's first invalid field takes the focus when the page loads, which scrolls it into view: a
        # form far down a page (a node's price) is otherwise sent back looking unchanged (issue 16).
        form = bound_field.form
        if next((name for name in form.fields if name in form.errors), None) == bound_field.name:
            attrs["autofocus"] = True
    widget_html = bound_field.as_widget(attrs=attrs)
    if bound_field.field.show_hidden_initial:  # the value the page showed, for form.changed_data (as {{ field }})
        widget_html += bound_field.as_hidden(only_initial=True)
    return {"f": bound_field, "kind": kind, "attrs": attrs, "widget_html": widget_html, "css_class": css_class}


@register.filter
def duration(seconds) -> str:
    """Seconds as "2 h 05 min", "4 min 10 s" or "12 s"; "–" for None."""
    if seconds is None or seconds == "":
        return "–"
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes:02d} min" if minutes else f"{hours} h"
    if minutes:
        return f"{minutes} min {secs:02d} s"
    return f"{secs} s"


@register.filter
def form_wide_errors(form) -> list[str]:
    """The errors shown above a form: its non-field errors, and those of its hidden fields (a page's own token,
    which no field marked below could show)."""
    errors = list(form.non_field_errors())
    for hidden in form.hidden_fields():
        errors += [f"{hidden.label}: {error}" for error in hidden.errors]
    return errors
