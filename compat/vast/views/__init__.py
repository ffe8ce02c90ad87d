"""The endpoints the `vastai` CLI calls, each translated into one service or selector of the apps (by meaning:
offers, instances, account, hosts; what they share is in base)."""
from .account import CurrentUserView, SshKeysView, SshKeyView
from .base import UnsupportedView
from .hosts import MachineListView, MachinesView, MachineUnlistView, MachineView
from .instances import InstanceFiltersView, InstanceListView, InstanceView, OfferCreateView
from .offers import OffersSearchView

__all__ = [
    "CurrentUserView", "InstanceFiltersView", "InstanceListView", "InstanceView", "MachineListView",
    "MachineUnlistView", "MachineView", "MachinesView", "OfferCreateView", "OffersSearchView", "SshKeyView",
    "SshKeysView", "UnsupportedView",
]
