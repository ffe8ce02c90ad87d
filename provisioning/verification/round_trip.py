"""The round trip the platform takes off a timed answer, and why it cannot be bought.

The agent's pongs time the round trip its answers travel, but the node answers them: a node that holds every pong
back by D seconds would have D seconds taken off its slow commitments and fresh roots. So the credit is the least
of the agent's pings and the round trips the agent does not answer (the SSH server's keepalive reply and the
platform kernel's TCP estimate, from an exchange that has `transport_round_trips()`, ssh_round_trip.py), and never
more than `round_trip_credit_max_s`, a long intercontinental round trip: a node that slowed its agent, its sshd
and its TCP stack alike still gains no more than that. Likewise the memory proof's jitter allowance takes the
spread of the steadier of the pings and sshd's replies.

Pure: the exchange is anything with send/receive; the transport round trips are optional.
"""
from __future__ import annotations

from typing import Any

from provisioning.verification.tolerances import TOLERANCES


def credit(ping_trips: list[float], exchange: Any) -> tuple[float, dict[str, float], float]:
    """(the seconds taken off each timed answer; the least round trip of each measurement by name, "agent_pings",
    "sshd", "tcp"; the spread of the steadiest measurement timed more than once, the slowest sample less the
    fastest, for the memory proof's jitter allowance: a node that answers its pongs unevenly must also answer
    sshd unevenly to widen it)."""
    samples = {"agent_pings": list(ping_trips)}
    below_agent = getattr(exchange, "transport_round_trips", None)
    if below_agent is not None:
        samples.update(below_agent())
    measured = {name: min(trips) for name, trips in samples.items()}
    repeated = [max(trips) - min(trips) for trips in samples.values() if len(trips) > 1]
    spread = min(repeated) if repeated else 0.0
    return min(min(measured.values()), TOLERANCES["round_trip_credit_max_s"]), measured, spread


def figures(measured: dict[str, float]) -> dict[str, float]:
    return {name: round(seconds, 6) for name, seconds in measured.items()}
