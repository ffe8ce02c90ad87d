"""A developer's machine and `make demo`: DEBUG on unless DEBUG=false is set."""
from .base import *  # noqa: F403
from .env import env_bool, env_networks

DEBUG = env_bool("DEBUG", True)
SIM_NODES_ALLOWED = env_bool("SIM_NODES_ALLOWED", True)  # `make demo` registers simulated servers
# `make demo`'s simulated servers are sshds on 127.0.0.1.
NODE_ADDRESS_ALLOWED_NETWORKS = env_networks("NODE_ADDRESS_ALLOWED_NETWORKS", ["127.0.0.0/8", "::1/128"])
