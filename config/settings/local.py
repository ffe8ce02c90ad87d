"""A developer's machine and `make demo`: DEBUG on unless DEBUG=false is set."""
from .base import *  # noqa: F403
from .env import env_bool

DEBUG = env_bool("DEBUG", True)
SIM_NODES_ALLOWED = env_bool("SIM_NODES_ALLOWED", True)  # `make demo` registers simulated servers
