"""The round trip the platform takes off a timed answer, and why it cannot be bought.

The agent's pongs time the round trip its answers travel, but the node answers them: a node that holds every pong
back by D seconds would have D seconds taken off its slow commitments and fresh roots. So the credit is the least
of the agent's pings and the round trips the agent does not answer (the SSH server's keepalive reply and the
platform kernel's TCP estimate, from an exchange that has `transport_round_trips()`, ssh_round_trip.py), and never
more than `round_trip_credit_max_s`, a long intercontinental round trip: a node that slowed its agent, its sshd
and its TCP stack alike still gains no more than that.

Pure: the exchange is anything with send/receive; the transport round trips are optional.
"""
from __future__ import annotations

from typing import Any

from provisioning.verification.policy import TOLERANCES


def credit(ping_trips: list[float], exchange: Any) -> tuple[float, dict[str, float]]:
    """(the seconds taken off each timed answer, every round trip measured by name: "agent_pings", "sshd",
    "tcp", as they were measured)."""
    measured = {"agent_pings": min(ping_trips)}
    below_agent = getattr(exchange, "transport_round_trips", None)
    if below_agent is not None:
        measured.update(below_agent())
    return min(min(measured.values()), TOLERANCES["round_trip_credit_max_s"]), measured


def figures(measured: dict[str, float]) -> dict[str, float]:
    return {name: round(seconds, 6) for name, seconds in measured.items()}
