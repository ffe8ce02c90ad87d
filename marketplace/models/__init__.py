from core.transitions import InvalidTransition  # defined once there; re-exported for the apps' imports

from .accounts import AccountStatusChange, ApiKey, User
from .catalogue import GpuModel
from .mig import MigSlice, MigSliceAllocation, SliceStatus
from .nodes import Gpu, GpuStatus, Node, NodeState, Runtime, Verdict
from .renting import (
    GpuAllocation,
    Image,
    Instance,
    InstanceStatus,
    Interruption,
    InterruptionCause,
    InterruptionOutcome,
    SshKey,
)
from .two_factor import AuthenticatorDevice, RecoveryCode, RecoveryCodeDevice
from .volumes import Volume, VolumeMount, VolumeState

__all__ = [
    "AccountStatusChange",
    "ApiKey",
    "AuthenticatorDevice",
    "Gpu",
    "GpuAllocation",
    "GpuModel",
    "GpuStatus",
    "Image",
    "Instance",
    "InstanceStatus",
    "Interruption",
    "InterruptionCause",
    "InterruptionOutcome",
    "InvalidTransition",
    "MigSlice",
    "MigSliceAllocation",
    "Node",
    "NodeState",
    "RecoveryCode",
    "RecoveryCodeDevice",
    "Runtime",
    "SliceStatus",
    "SshKey",
    "User",
    "Verdict",
    "Volume",
    "VolumeMount",
    "VolumeState",
]
