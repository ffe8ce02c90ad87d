"""nvidia-smi parsing, the GPU inventory and the host's facts."""
import contextlib
import csv
import hashlib
import json
import os
import platform
import re
import shutil
import time

from .core import AgentError, read_json, run

QUERY_FIELDS = (
    "index", "uuid", "name", "memory.total", "pci.bus_id", "pci.device_id", "pcie.link.gen.max",
    "pcie.link.gen.current", "pcie.link.width.max", "pcie.link.width.current", "power.limit",
    "power.default_limit", "mig.mode.current", "ecc.mode.current", "driver_version",
)
NVIDIA_SMI_QUERY = ["nvidia-smi", "--query-gpu=" + ",".join(QUERY_FIELDS), "--format=csv,noheader,nounits"]
# nvidia-smi field -> key in our answer: dots become underscores, units are named, ".current" modes shortened.
_KEYS = dict({f: f.replace(".", "_") for f in QUERY_FIELDS}, **{
    "memory.total": "memory_total_mib", "power.limit": "power_limit_w",
    "power.default_limit": "power_default_limit_w", "mig.mode.current": "mig_mode", "ecc.mode.current": "ecc_mode"})
_INT_FIELDS = {"index", "memory.total", "pcie.link.gen.max", "pcie.link.gen.current",
               "pcie.link.width.max", "pcie.link.width.current"}
_FLOAT_FIELDS = {"power.limit", "power.default_limit"}
# nvidia-smi prints these instead of a value; "[N/A]" in csv mode, "N/A" in some drivers' outputs.
_MISSING = re.compile(r"^\[?(N/A|Not Supported|Unknown Error|Insufficient Permissions|"
                      r"GPU requires reset|Requested functionality has been deprecated)\]?$", re.I)


def smi_value(field, raw):
    raw = raw.strip()
    if not raw or _MISSING.match(raw):
        return None
    if field in _INT_FIELDS:
        return int(raw)
    if field in _FLOAT_FIELDS:
        return float(raw)
    if field in ("mig.mode.current", "ecc.mode.current"):
        return raw.capitalize()  # "Enabled" / "Disabled"
    return raw


def split_smi_line(line):
    # csv with skipinitialspace copes with the ", " separators; GPU names never contain commas.
    return [cell.strip() for cell in next(csv.reader([line], skipinitialspace=True))]


def parse_gpu_csv(text):
    """Parse `nvidia-smi --query-gpu=<QUERY_FIELDS> --format=csv,noheader,nounits` into dicts."""
    gpus = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        cells = split_smi_line(line)
        if len(cells) != len(QUERY_FIELDS):
            raise AgentError("nvidia_smi_unparsable", "line %d has %d fields, expected %d: %r" % (
                lineno, len(cells), len(QUERY_FIELDS), line[:200]))
        try:
            gpu = {_KEYS[f]: smi_value(f, cells[n]) for n, f in enumerate(QUERY_FIELDS)}
        except ValueError as exc:
            raise AgentError("nvidia_smi_unparsable", "line %d: %s" % (lineno, exc)) from None
        if gpu["index"] is None:
            raise AgentError("nvidia_smi_unparsable", "line %d has no GPU index" % lineno)
        gpus.append(gpu)
    return gpus


def parse_cuda_version(header):
    """CUDA version from the banner of plain `nvidia-smi` ("... CUDA Version: 12.2 |")."""
    match = re.search(r"CUDA Version\s*:\s*([0-9]+\.[0-9]+)", header)
    return match.group(1) if match else None


def load_profile(path):
    """A sim profile and its GPUs, parsed by the same parser as real nvidia-smi output."""
    try:
        profile = read_json(path)
    except (OSError, ValueError) as exc:
        raise AgentError("bad_node_config", "cannot read sim profile %s: %s" % (path, exc)) from None
    return profile, parse_gpu_csv("\n".join(profile.get("nvidia_smi", [])))


# ---------------------------------------------------------------------------------------- inventory

def read_gpus(cfg):
    """(gpus, cuda_version): from the sim profile, or from the real nvidia-smi."""
    if cfg.runtime == "sim":
        profile, gpus = load_profile(cfg.sim_profile)
        return gpus, profile.get("cuda_version")
    gpus = parse_gpu_csv(run(NVIDIA_SMI_QUERY, timeout=30).stdout)
    return gpus, parse_cuda_version(run(["nvidia-smi"], timeout=30, check=False).stdout)


DISK_TEST_MIB = 32  # the disk test's size: small and bounded (a few seconds on the slowest disk worth renting)
DISK_TEST_MAX_MIB = 256


def disk_bandwidth(directory, mib=DISK_TEST_MIB):
    """Write `mib` MiB to a file in `directory` (fsync'd), drop it from the page cache, read it back; MB/s each way.

    None for a figure that could not be measured (no room, a read-only folder): the check says so rather than guess.
    """
    mib = max(1, min(int(mib), DISK_TEST_MAX_MIB))
    block = os.urandom(1 << 20)
    path = os.path.join(directory, ".gpumarket-disk-test-%d" % os.getpid())
    answer = {"test_mib": mib, "write_mbs": None, "read_mbs": None}
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            started = time.perf_counter()
            for _ in range(mib):
                os.write(fd, block)
            os.fsync(fd)
            answer["write_mbs"] = round(mib * (1 << 20) / 1e6 / max(time.perf_counter() - started, 1e-6), 1)
            with contextlib.suppress(AttributeError, OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the read below comes from the disk
        finally:
            os.close(fd)
        fd = os.open(path, os.O_RDONLY)
        try:
            started = time.perf_counter()
            while os.read(fd, 1 << 20):
                pass
            answer["read_mbs"] = round(mib * (1 << 20) / 1e6 / max(time.perf_counter() - started, 1e-6), 1)
        finally:
            os.close(fd)
    except OSError as exc:
        answer["error"] = str(exc)[:200]
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return answer


def _disk_test_mib():
    try:
        return int(os.environ.get("GPUMARKET_DISK_TEST_MIB") or DISK_TEST_MIB)
    except ValueError:
        return DISK_TEST_MIB


def host_facts(cfg):
    # The disk test runs on the file system the VMs' disks and volumes live on, for real, on every runtime (the
    # sim's too: only GPUs are simulated).
    disk = disk_bandwidth(cfg.state_dir, _disk_test_mib())
    if cfg.runtime == "sim":
        host = load_profile(cfg.sim_profile)[0].get("host", {})
        disk["free_gb"], disk["total_gb"] = host.get("disk_free_gb"), host.get("disk_total_gb")
        return {"cpu": {"model": host.get("cpu_model"), "cores": host.get("cpu_cores")},
                "ram_mib": host.get("ram_mib"), "disk_free_gb": host.get("disk_free_gb"), "disk": disk,
                "os": {"name": host.get("os"), "kernel": host.get("kernel"), "arch": host.get("arch", "x86_64")}}
    cpu_model = ram_mib = os_name = None
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu_model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    with contextlib.suppress(OSError):
        with open("/proc/meminfo") as f:
            ram_mib = next((int(ln.split()[1]) // 1024 for ln in f if ln.startswith("MemTotal:")), None)
    with contextlib.suppress(OSError):
        with open("/etc/os-release") as f:
            os_name = next((ln.split("=", 1)[1].strip().strip('"') for ln in f
                            if ln.startswith("PRETTY_NAME=")), None)
    usage = shutil.disk_usage(os.environ.get("GPUMARKET_DISK_PATH") or "/")
    # Free now, and the file system's size: the platform never promises more disk than the size (disks and
    # volumes take their room as they fill, not when promised: marketplace/services/disk_room.py).
    disk["free_gb"], disk["total_gb"] = usage.free // 10**9, usage.total // 10**9
    return {"cpu": {"model": cpu_model, "cores": os.cpu_count()}, "ram_mib": ram_mib,
            "disk_free_gb": usage.free // 10**9, "disk": disk,
            "os": {"name": os_name, "kernel": platform.release(), "arch": platform.machine()}}


# What identifies a node's GPUs; not what moves with load (current link speed, clocks).
IDENTITY_FIELDS = ("index", "uuid", "name", "memory_total_mib", "pci_bus_id", "pci_device_id", "pcie_link_gen_max",
                   "pcie_link_width_max", "power_limit_w", "power_default_limit_w", "mig_mode", "ecc_mode",
                   "driver_version")


def inventory_hash(gpus):
    """A short digest of the GPUs' identity: the platform re-verifies a node whose digest changed."""
    rows = [[g.get(k) for k in IDENTITY_FIELDS] for g in sorted(gpus, key=lambda g: g.get("index") or 0)]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]
