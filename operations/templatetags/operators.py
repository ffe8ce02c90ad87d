"""The operators' dashboard on the admin index page: the parts the operator may view in the admin (PARTS)."""
from django import template

from operations.dashboard import fleet_figures, parts_for

register = template.Library()


@register.inclusion_tag("admin/includes/fleet_dashboard.html", takes_context=True)
def fleet_dashboard(context):
    return {"fleet": fleet_figures(parts_for(context["request"]))}
