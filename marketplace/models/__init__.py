from .accounts import ApiKey, User
from .catalogue import GpuModel
from .nodes import Gpu, GpuStatus, InvalidTransition, Node, NodeState, Runtime, Verdict

__all__ = [
    "ApiKey",
    "Gpu",
    "GpuModel",
    "GpuStatus",
    "InvalidTransition",
    "Node",
    "NodeState",
    "Runtime",
    "User",
    "Verdict",
]
