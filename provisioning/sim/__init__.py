"""Simulated GPU servers on this machine: each one a real OpenSSH sshd running the agent in `sim` mode."""
from provisioning.sim.nodes import (
    PROFILES_DIR,
    node_authorize,
    node_cut,
    node_down,
    node_restore,
    node_up,
    nodes_down,
    nodes_list,
    resolve_profile,
    simnodes_dir,
)

__all__ = [
    "PROFILES_DIR",
    "node_authorize",
    "node_cut",
    "node_down",
    "node_restore",
    "node_up",
    "nodes_down",
    "nodes_list",
    "resolve_profile",
    "simnodes_dir",
]
