"""What the benchmark check measured about a node's host (not its GPUs): shown on offers, filtered and ordered on.

Columns on the node itself, not a JSON field or a joined table, so that the offers search filters and orders on
them in SQL without a join. Written only by the check (provisioning.services.verification, from the agent's
inventory and the platform's own network test); null until a check measured them.
"""
import re

from django.db import models

CUDA_VERSION_RE = re.compile(r"^([1-9][0-9]?)\.([0-9]{1,2})$")
# Disk storage is priced per GB per month; a month is 30 days of seconds for per-second billing.
SECONDS_PER_MONTH = 30 * 24 * 3600
DEFAULT_DISK_PRICE_PER_GB_MONTH_MICROS = 100_000  # USD 0.10 per GB-month until the provider sets one


def cuda_version_code(text: str) -> int | None:
    """"12.2" -> 12020 (CUDA's own major*1000 + minor*10 encoding, so that 12.10 > 12.2 in SQL); None if not X.Y."""
    match = CUDA_VERSION_RE.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
        return None
    return int(match.group(1)) * 1000 + int(match.group(2)) * 10


def cuda_version_text(code: int | None) -> str | None:
    if code is None:
        return None
    return f"{code // 1000}.{code % 1000 // 10}"


class NodeHostFacts(models.Model):
    """Abstract: the host's measured facts, mixed into Node."""

    cpu_model = models.CharField(max_length=200, blank=True, help_text="As /proc/cpuinfo names it.")
    cpu_cores = models.PositiveIntegerField(null=True, blank=True, help_text="Logical CPUs.")
    ram_gb = models.PositiveIntegerField(null=True, blank=True)
    disk_free_gb = models.PositiveIntegerField(null=True, blank=True, help_text="Free on the VMs' file system.")
    disk_total_gb = models.PositiveIntegerField(null=True, blank=True, help_text="The size of that file system.")
    disk_bandwidth_mbs = models.FloatField(
        null=True, blank=True, help_text="MB/s: the lower of write (with fsync) and read, measured by the agent.")
    driver_version = models.CharField(max_length=32, blank=True)
    cuda_version = models.PositiveIntegerField(
        null=True, blank=True, help_text="Highest CUDA version the driver runs, as major*1000 + minor*10.")
    pcie_gen = models.PositiveSmallIntegerField(null=True, blank=True, help_text="Lowest max PCIe generation.")
    pcie_width = models.PositiveSmallIntegerField(null=True, blank=True, help_text="Lowest max PCIe link width.")
    net_mbps = models.FloatField(
        null=True, blank=True,
        help_text="Mbit/s from the platform to the node over SSH, measured by the platform (encrypted stream).")
    host_checked_at = models.DateTimeField(null=True, blank=True, help_text="When the host facts were measured.")

    class Meta:
        abstract = True
