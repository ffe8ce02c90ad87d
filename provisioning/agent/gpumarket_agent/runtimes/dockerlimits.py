"""How much of the host one container gets: a share of its cores, memory and process ids in proportion to the
container's GPUs (container_share, host_resources), as docker create's options (limits_argv), and the disk limit
where the engine's storage or volume driver can enforce one (unsupported_size_option tells its refusal apart)."""
import contextlib
import os

HOST_RAM_KEPT = 0.1  # of the host's RAM, never given to containers (as libvirt_share)
PIDS_PER_GPU_MIN = 1024
MIG_SLICES_PER_GPU = 7  # a MIG device counts as 1/7 of its GPU in the share


def container_share(host_cores, host_ram_mib, host_pids, gpus, total_gpus):
    """(cpus, memory MiB, pids) for a container of `gpus` GPUs (a fraction for MIG slices) of `total_gpus`:
    in proportion, as libvirt_share; 10 % of RAM and half the process ids stay with the host."""
    part = min(1.0, float(gpus) / max(1, total_gpus))
    cpus = max(1.0, round(host_cores * part, 2))
    memory = max(2048, int(int(host_ram_mib * (1 - HOST_RAM_KEPT)) * part))
    pids = max(PIDS_PER_GPU_MIN, int(host_pids // 2 * part))
    return min(cpus, float(max(1, host_cores))), memory, pids


def disk_limit_answer(limits):
    """The VM's "disk_limit": "enforced" only when the writable layer is limited and no VOLUME of the image sits
    outside that limit (`unbounded_volumes`: each is an anonymous volume no limit bounds; review r53 #1)."""
    if limits.get("disk_limit") == "enforced" and not limits.get("unbounded_volumes"):
        return "enforced"
    return "not_enforced"


def limits_text(limits):
    text = "%g CPUs, %d MiB memory, %d processes, disk %s GB %s" % (
        limits["cpus"], limits["memory_mib"], limits["pids"], limits.get("disk_gb"),
        "enforced" if disk_limit_answer(limits) == "enforced" else "NOT enforced")
    if limits.get("unbounded_volumes"):
        text += " (the image's VOLUME %s: no size limit)" % ", ".join(limits["unbounded_volumes"])
    return text


def limits_argv(limits):
    """docker create's resource limits: memory with no swap beyond it, CPUs, process ids, and the disk."""
    argv = ["--memory", "%dm" % limits["memory_mib"], "--memory-swap", "%dm" % limits["memory_mib"],
            "--cpus", "%g" % limits["cpus"], "--pids-limit", str(limits["pids"])]
    if limits.get("disk_gb") and limits.get("disk_limit") == "enforced":
        argv += ["--storage-opt", "size=%dG" % limits["disk_gb"]]
    return argv


def host_resources():
    """(cores, RAM MiB, process ids the kernel allows) of this host: cheap reads, no disk test."""
    ram_mib, pids = 4096, 32768
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/meminfo") as f:
            ram_mib = next(int(ln.split()[1]) // 1024 for ln in f if ln.startswith("MemTotal:"))
    for path in ("/proc/sys/kernel/pid_max", "/proc/sys/kernel/threads-max"):
        with contextlib.suppress(OSError, ValueError):
            with open(path) as f:
                pids = min(pids, int(f.read().strip())) if path.endswith("threads-max") else int(f.read().strip())
    return os.cpu_count() or 1, ram_mib, pids


def unsupported_size_option(stderr):
    """docker's refusal of a size option the storage or volume driver cannot enforce (overlay2 off xfs+pquota,
    the local volume driver without quota support), as opposed to any other failure."""
    text = stderr.lower()
    return any(needle in text for needle in ("storage-opt", "storage opt", "storage option", "quota",
                                             "invalid option", "size option", "not supported"))
