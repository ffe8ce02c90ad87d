"""For the navigation (marketplace/base.html): `{% load notifications_web %}{% unread_notifications as unread %}`
gives the signed-in user's unread count (0 for everyone else), one COUNT on an index."""
from django import template

from notifications import selectors

register = template.Library()


@register.simple_tag(takes_context=True)
def unread_notifications(context) -> int:
    request = context.get("request")
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return 0
    return selectors.unread_count(user=user)
