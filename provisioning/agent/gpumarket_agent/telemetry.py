"""nvidia-smi sampled while the benchmark runs."""
import statistics
import threading

from .core import AgentError, run
from .smi import split_smi_line

TELEMETRY_FIELDS = ["index", "clocks.sm", "clocks.max.sm", "power.draw", "temperature.gpu",
                    "clocks_event_reasons.active", "pcie.link.gen.current", "pcie.link.width.current"]
# NVML's clock event ("throttle") reason bits, as `clocks_event_reasons.active` prints them (hex).
CLOCK_EVENT_BITS = ((0x1, "GpuIdle"), (0x2, "ApplicationsClocksSetting"), (0x4, "SwPowerCap"), (0x8, "HwSlowdown"),
                    (0x10, "SyncBoost"), (0x20, "SwThermalSlowdown"), (0x40, "HwThermalSlowdown"),
                    (0x80, "HwPowerBrakeSlowdown"), (0x100, "DisplayClockSetting"))
LOAD_PHASES = ("warmup", "bf16", "fp16", "tf32", "fp32", "copy", "host", "cnn", "check")


def clock_event_names(raw):
    try:
        bits = int(raw, 16)
    except ValueError:
        return []
    return [name for bit, name in CLOCK_EVENT_BITS if bits & bit]


def parse_telemetry(text):
    """Rows of `nvidia-smi --query-gpu=<TELEMETRY_FIELDS> --format=csv,noheader,nounits`."""
    def num(cell):
        try:
            return float(cell)
        except ValueError:
            return None  # [N/A], [Not Supported]
    rows = []
    for line in text.splitlines():
        cells = split_smi_line(line) if line.strip() else []
        if len(cells) == len(TELEMETRY_FIELDS) and cells[0].isdigit():
            rows.append({"index": int(cells[0]), "sm_clock_mhz": num(cells[1]), "sm_clock_max_mhz": num(cells[2]),
                         "power_draw_w": num(cells[3]), "temperature_c": num(cells[4]),
                         "clocks_event_reasons": clock_event_names(cells[5]), "pcie_link_gen": num(cells[6]),
                         "pcie_link_width": num(cells[7])})
    return rows


class Telemetry(threading.Thread):
    """nvidia-smi sampled every `interval` s while the benchmark runs; each sample is tagged with the phase."""

    def __init__(self, indices, interval=0.5):
        super().__init__(daemon=True)
        self.indices, self.interval, self.phase = indices, interval, "start"
        self.fields, self.samples, self.error = list(TELEMETRY_FIELDS), [], None
        self.done = threading.Event()

    def run(self):
        while True:
            self.sample()
            if self.done.wait(self.interval):
                return

    def sample(self):
        for _ in range(2):
            argv = ["nvidia-smi", "-i", ",".join(str(i) for i in self.indices),
                    "--query-gpu=" + ",".join(self.fields), "--format=csv,noheader,nounits"]
            try:
                proc = run(argv, timeout=10, check=False)
            except AgentError as exc:
                self.error = exc.message
                return
            if proc.returncode == 0 or self.fields[5] != TELEMETRY_FIELDS[5]:
                break
            self.fields[5] = "clocks_throttle_reasons.active"  # its name before driver 535
        if proc.returncode != 0:
            self.error = (proc.stderr or proc.stdout).strip()[-300:]
            return
        phase = self.phase
        self.samples.extend(dict(row, phase=phase) for row in parse_telemetry(proc.stdout))

    def stop(self):
        self.done.set()
        self.join(15)

    def summary(self, index):
        rows = [r for r in self.samples if r["index"] == index]
        loaded = [r for r in rows if r["phase"] in LOAD_PHASES] or rows

        def values(key, among):
            return [r[key] for r in among if r[key] is not None]
        counts = {}
        for row in loaded:
            for name in row["clocks_event_reasons"]:
                counts[name] = counts.get(name, 0) + 1
        pick = {"sm_clock_mhz": (statistics.median, loaded), "sm_clock_max_mhz": (max, rows),
                "power_draw_w": (max, loaded), "temperature_c": (max, rows), "pcie_link_gen": (max, rows),
                "pcie_link_width": (max, rows)}
        summary = {key: (fn(values(key, among)) if values(key, among) else None) for key, (fn, among) in pick.items()}
        summary.update(samples=len(rows), clocks_event_reasons=sorted(counts), clocks_event_reason_samples=counts,
                       error=self.error)
        return summary
