"""The site's navigation, in one place (issue 16): which links whom sees, in which group.

Everyone sees the offers and the GPU comparison; a signed-in user sees their renting (instances), money and
account; provider pages only once they have a server (or are on one of those pages: they chose to become a
provider), else one "Provide GPUs" entry; operators (staff) their own. A link whose URL name does not exist is
left out, so an entry can be added here before its page is merged.

To add a page: one NavLink in NAV, with its group (None: the top bar; or a GROUPS key: a menu in the top bar)
and who sees it (AUDIENCES). marketplace/templates/marketplace/base.html draws it; site.js folds it into a
"Menu" button on a phone.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from django.urls import NoReverseMatch, reverse
from django.utils.functional import SimpleLazyObject

# Who sees a link: "anyone", "anonymous" (signed out), "user" (signed in), "provider" (signed in with a server,
# or on a provider page), "not_provider" (signed in without one), "staff" (operators).
AUDIENCES = ("anyone", "anonymous", "user", "provider", "not_provider", "staff")


@dataclass(frozen=True)
class NavLink:
    label: str
    url_name: str
    audience: str = "anyone"
    group: str | None = None  # None: in the top bar; else a key of GROUPS
    prefix: str | None = None  # paths under it mark the link current (default: the link's own path)
    button: bool = False  # drawn as a button (Sign up)


# The menus in the top bar, in order: key -> label.
GROUPS = {"provider": "Provider", "money": "Billing", "account": "Account"}

NAV: list[NavLink] = [
    NavLink("Offers", "offers"),
    NavLink("Compare GPUs", "gpu-compare"),
    NavLink("Instances", "instances", "user"),
    NavLink("Volumes", "volumes", "user"),
    NavLink("Provide GPUs", "node-register", "not_provider"),
    # A provider's pages
    NavLink("My servers", "nodes", "provider", "provider", prefix="/nodes/"),
    NavLink("Earnings", "web-earnings", "provider", "provider"),
    NavLink("Payouts", "web-payouts", "provider", "provider"),
    # Money
    NavLink("Balance", "web-balance", "user", "money", prefix="/account/balance/"),
    NavLink("Usage", "web-usage", "user", "money"),
    NavLink("Statements", "web-statements", "user", "money"),
    # The account
    NavLink("SSH keys", "ssh-keys", "user", "account"),
    NavLink("API keys", "api-keys", "user", "account"),
    NavLink("Security", "account-security", "user", "account"),
    NavLink("Notifications", "notifications", "user", "account", prefix="/account/notifications/"),
    # Operators
    NavLink("Operators", "admin:index", "staff"),
    # Signed out
    NavLink("Log in", "login", "anonymous"),
    NavLink("Sign up", "signup", "anonymous", button=True),
]

# A page under one of these is a provider's: whoever opens one has chosen to provide, and sees the others.
PROVIDER_PATHS = ("/nodes/", "/earnings/", "/payouts/")


@dataclass(frozen=True)
class Link:
    label: str
    url: str
    current: bool
    button: bool = False


@dataclass(frozen=True)
class Group:
    key: str
    label: str
    links: tuple[Link, ...]

    @property
    def current(self) -> bool:
        return any(link.current for link in self.links)


class Navigation:
    """What the navigation shows to this request's user; computed when a template first asks (admin pages,
    which draw their own, never do)."""

    def __init__(self, request):
        self.request = request
        self.user = getattr(request, "user", None)
        self.path = getattr(request, "path", "")

    @cached_property
    def is_provider(self) -> bool:
        from marketplace.models import Node

        if not (self.user and self.user.is_authenticated):
            return False
        return self.path.startswith(PROVIDER_PATHS) or Node.objects.filter(provider=self.user).exists()

    def _sees(self, audience: str) -> bool:
        signed_in = bool(self.user and self.user.is_authenticated)
        return {
            "anyone": True, "anonymous": not signed_in, "user": signed_in,
            "provider": signed_in and self.is_provider, "not_provider": signed_in and not self.is_provider,
            "staff": signed_in and self.user.is_staff,
        }[audience]

    def _link(self, entry: NavLink) -> Link | None:
        try:
            url = reverse(entry.url_name)
        except NoReverseMatch:
            return None
        prefix = entry.prefix or url
        current = self.path == url or (prefix != "/" and self.path.startswith(prefix))
        return Link(entry.label, url, current, entry.button)

    @cached_property
    def _entries(self) -> list[tuple[NavLink, Link]]:
        shown = []
        for entry in NAV:
            if self._sees(entry.audience) and (link := self._link(entry)) is not None:
                shown.append((entry, link))
        return shown

    @cached_property
    def items(self) -> list[Link | Group]:
        """The top bar in NAV's order: links, and each menu (a Group) where its first link stands."""
        items: list[Link | Group] = []
        placed: set[str] = set()
        for entry, link in self._entries:
            if entry.group is None:
                items.append(link)
            elif entry.group not in placed:
                placed.add(entry.group)
                links = tuple(other for e, other in self._entries if e.group == entry.group)
                items.append(Group(entry.group, GROUPS[entry.group], links))
        return items

    @property
    def links(self) -> list[Link]:
        """Every link shown, menus' included."""
        return [link for _, link in self._entries]


def navigation(request) -> dict:
    """Context processor: `nav` (a Navigation, lazily)."""
    return {"nav": SimpleLazyObject(lambda: Navigation(request))}
