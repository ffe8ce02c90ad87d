"""The operators' panel for accounts, the catalogue, nodes, GPUs and rentals. No secret is ever shown.

Importing the package registers every ModelAdmin (Django's autodiscovery imports `marketplace.admin`).
"""
from .accounts import AdminLoginForm, ApiKeyAdmin, SshKeyAdmin, UserAddForm, UserAdmin
from .nodes import GpuAdmin, GpuInline, GpuModelAdmin, MigSliceAdmin, NodeAdmin
from .renting import ImageAdmin, InstanceAdmin, InterruptionAdmin, VolumeAdmin

__all__ = [
    "AdminLoginForm",
    "ApiKeyAdmin",
    "GpuAdmin",
    "GpuInline",
    "GpuModelAdmin",
    "ImageAdmin",
    "InstanceAdmin",
    "InterruptionAdmin",
    "MigSliceAdmin",
    "NodeAdmin",
    "SshKeyAdmin",
    "UserAddForm",
    "UserAdmin",
    "VolumeAdmin",
]
