"""The GPUs' interconnect: `nvidia-smi topo -m` (how each pair is connected), `nvidia-smi nvlink -s` (each GPU's
links and their speed), and peer-to-peer copy bandwidth between GPU pairs. The sim prints the same text from its
profile's `topology` and the agent parses it with the same parsers; its p2p copies take the time they would."""
import re
import time

from .core import AgentError, run

P2P_BYTES = 256 << 20  # one copy per pair: long enough to time, short enough for 28 pairs on 8 GPUs


def parse_topo_matrix(text):
    """{(a, b): "NV12" | "SYS" | "PIX" | ...} for each GPU pair of `nvidia-smi topo -m` (a < b)."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    header = next((line.split() for line in lines if re.match(r"^\s+GPU0\b", line)), None)
    if header is None:
        return {}
    gpus = [int(h[3:]) for h in header if re.fullmatch(r"GPU\d+", h)]
    pairs = {}
    for line in lines:
        cells = line.split()
        if not cells or not re.fullmatch(r"GPU\d+", cells[0]) or len(cells) < len(gpus) + 1:
            continue
        a = int(cells[0][3:])
        for b, cell in zip(gpus, cells[1:len(gpus) + 1]):  # noqa: B905 - the agent runs on older Pythons too
            if a < b:
                pairs[(a, b)] = cell
    return pairs


def parse_nvlink_status(text):
    """{gpu: {"links_total", "links_active", "link_gbs"}} from `nvidia-smi nvlink -s` (inactive links count too)."""
    found, current = {}, None
    for line in text.splitlines():
        head = re.match(r"^GPU (\d+):", line)
        if head:
            current = found.setdefault(int(head.group(1)), {"links_total": 0, "links_active": 0, "link_gbs": None})
            continue
        link = re.match(r"^\s+Link \d+:\s*(.*)$", line)
        if link and current is not None:
            current["links_total"] += 1
            speed = re.match(r"([0-9.]+)\s*GB/s", link.group(1))
            if speed:
                current["links_active"] += 1
                current["link_gbs"] = max(current["link_gbs"] or 0.0, float(speed.group(1)))
    return found


def nvlink_islands(pairs):
    """The sets of GPUs joined by NVLink (connected components over NV# pairs), each sorted, largest first."""
    parent = {}

    def root(x):
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x
    for (a, b), kind in pairs.items():
        if kind.startswith("NV"):
            parent[root(a)] = root(b)
    groups = {}
    for gpu in parent:
        groups.setdefault(root(gpu), []).append(gpu)
    return sorted((sorted(g) for g in groups.values() if len(g) > 1), key=lambda g: (-len(g), g))


def describe_topology(topo_text, nvlink_text):
    """The topology as the inventory reports it: each pair's connection, each GPU's links, the NVLink islands."""
    pairs = parse_topo_matrix(topo_text)
    links = parse_nvlink_status(nvlink_text)
    return {"pairs": [{"a": a, "b": b, "link": kind} for (a, b), kind in sorted(pairs.items())],
            "gpus": [{"index": i, **links[i]} for i in sorted(links)],
            "nvlink_islands": nvlink_islands(pairs)}


# ------------------------------------------------------------------------------------------------ the sim

def _sim_links(topo):
    """Per GPU: (links total, links active) as the profile's `topology` sets them."""
    total = topo.get("links_per_gpu", 0)
    active = {int(k): v for k, v in (topo.get("active_links") or {}).items()}
    members = {g for island in topo.get("nvlink_islands", []) for g in island}
    return {g: (total, active.get(g, total)) for g in members}


def sim_topo_text(profile, gpus):
    """`nvidia-smi topo -m` as the profile's hardware would print it."""
    topo = profile.get("topology") or {}
    island_of = {g: n for n, island in enumerate(topo.get("nvlink_islands", [])) for g in island}
    links = _sim_links(topo)
    indices = [g["index"] for g in gpus]
    rows = ["\t" + "\t".join("GPU%d" % i for i in indices) + "\tCPU Affinity\tNUMA Affinity"]
    for a in indices:
        cells = []
        for b in indices:
            if a == b:
                cells.append("X")
            elif a in island_of and island_of.get(b) == island_of[a]:
                cells.append("NV%d" % min(links[a][1], links[b][1]))
            else:
                cells.append(topo.get("other", "SYS"))
        rows.append("GPU%d\t" % a + "\t".join(cells) + "\t0-63\t0")
    legend = ("\n\nLegend:\n\n  X    = Self\n  SYS  = Connection traversing PCIe as well as the SMP interconnect "
              "between NUMA nodes\n  NV#  = Connection traversing a bonded set of # NVLinks\n")
    return "\n".join(rows) + legend


def sim_nvlink_text(profile, gpus):
    """`nvidia-smi nvlink -s` as the profile's hardware would print it (inactive links as `<inactive>`)."""
    topo = profile.get("topology") or {}
    links = _sim_links(topo)
    out = []
    for gpu in gpus:
        out.append("GPU %d: %s (UUID: %s)" % (gpu["index"], gpu["name"], gpu["uuid"]))
        total, active = links.get(gpu["index"], (0, 0))
        for n in range(total):
            out.append("\t Link %d: %s" % (n, "%g GB/s" % topo.get("link_gbs", 25) if n < active else "<inactive>"))
    return "\n".join(out) + "\n"


def sim_p2p_gbs(profile, a, b):
    """What a copy from GPU a to GPU b really reaches on the profile's hardware: the island's figure scaled by the
    pair's active links, else the PCIe figure."""
    topo = profile.get("topology") or {}
    p2p = topo.get("p2p_gbs") or {}
    links = _sim_links(topo)
    island = next((i for i in topo.get("nvlink_islands", []) if a in i and b in i), None)
    if island is None:
        return p2p.get("pcie", 20.0)
    total = max(links[a][0], 1)
    return p2p.get("nvlink", 200.0) * min(links[a][1], links[b][1]) / total


# ---------------------------------------------------------------------------------------- reading, measuring

def read_topology(cfg, gpus, profile=None):
    """The inventory's `topology`; None when nvidia-smi cannot tell (an old driver without `topo`)."""
    if cfg.runtime == "sim":
        return describe_topology(sim_topo_text(profile or {}, gpus), sim_nvlink_text(profile or {}, gpus))
    try:
        topo = run(["nvidia-smi", "topo", "-m"], timeout=30).stdout
        nvlink = run(["nvidia-smi", "nvlink", "-s"], timeout=30, check=False).stdout
    except AgentError:
        return None
    return describe_topology(topo, nvlink)


def measure_p2p(indices, copy_seconds):
    """GB/s of one P2P_BYTES copy for each pair (a < b) of `indices`; copy_seconds(a, b) times one copy."""
    out = []
    for n, a in enumerate(indices):
        for b in indices[n + 1:]:
            seconds = copy_seconds(a, b)
            out.append({"a": a, "b": b, "gbs": round(P2P_BYTES / seconds / 1e9, 1) if seconds > 0 else None})
    return out


def sim_copy_seconds(profile, noisy, wait=True):
    """A sim copy: it answers no sooner than the real hardware's copy would take, and reports that time (the
    sleep's own overshoot on a loaded host is the simulation's, not the hardware's). `wait=False` is for judging
    profiles in process (bench/verdict_stability.py): the same figures without the hardware's wall time."""
    def copy(a, b):
        seconds = P2P_BYTES / (noisy(sim_p2p_gbs(profile, a, b)) * 1e9)
        until = time.monotonic() + seconds
        while wait and time.monotonic() < until:
            time.sleep(max(0.0, until - time.monotonic()))
        return seconds
    return copy


def torch_copy_seconds(torch):
    """A real copy: a device-to-device tensor copy (peer-to-peer where the driver allows it), warmed up once."""
    def copy(a, b):
        src = torch.empty(P2P_BYTES, dtype=torch.uint8, device="cuda:%d" % a)
        dst = torch.empty(P2P_BYTES, dtype=torch.uint8, device="cuda:%d" % b)
        dst.copy_(src)
        torch.cuda.synchronize(a)
        torch.cuda.synchronize(b)
        started = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(a)
        torch.cuda.synchronize(b)
        taken = time.perf_counter() - started
        del src, dst
        return taken
    return copy
