"""The operators' dashboard on the admin index page."""
from django import template

from operations.dashboard import fleet_figures

register = template.Library()


@register.inclusion_tag("admin/includes/fleet_dashboard.html")
def fleet_dashboard():
    return {"fleet": fleet_figures()}
