"""A verification run's findings as a person reads them (issue 16): each finding said once with the GPUs it
concerns, not once per GPU, and what the measured figures do match in the catalogue.

The policy (policy.py) keeps one finding per GPU, with its machine-readable code and GPU index: the API, the
node's history and the admin's raw view keep them as they are. Here findings with the same severity, code and
wording (figures aside) become one sentence: "Each of GPUs 0–11 has 84 streaming multiprocessors; an A100 80GB
SXM has 108."; figures that differ between the GPUs become ranges ("111.5–112.9 TFLOP/s"). Pure functions, no
Django: the web pages, the admin and the service that writes a node's last error use the same words.
"""
from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from provisioning.verification.articles import mend_articles, with_article
from provisioning.verification.model import REJECT, DeclaredModel

# A number as the policy writes it: "84", "111.5", "2,039", "0.45".
_NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")
_SUBJECT, _INDEX = "\x00", "\x01"  # where the GPU ("GPU 3") and a command's index (`-i 3`) stood


@dataclass(frozen=True)
class Reason:
    """One finding as said once: its severity and code, the GPUs it concerns (empty: the whole server)."""

    severity: str
    code: str
    gpus: tuple[int, ...]
    text: str

    @property
    def gpus_text(self) -> str:
        return gpu_list(self.gpus)


def gpu_list(indices: Sequence[int]) -> str:
    """"GPU 3", "GPUs 0 and 2", "GPUs 0–11", "GPUs 0–3 and 6"."""
    indices = sorted(set(indices))
    if not indices:
        return ""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    parts = [f"{r[0]}–{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs]
    joined = parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"
    if len(indices) == 2 and len(runs) == 1:
        joined = f"{indices[0]} and {indices[1]}"
    return f"GPU{'s' if len(indices) > 1 else ''} {joined}"


def _template(message: str, index: int | None) -> str:
    text = mend_articles(message)
    if index is None:
        return text
    text = re.sub(rf"(?<![\w-])-i {index}\b", f"-i {_INDEX}", text)
    return re.sub(rf"\bGPU {index}\b(?!s)", _SUBJECT, text)


def _merge_numbers(texts: list[str]) -> str:
    """The texts share their words; each number that differs between them becomes "least–most"."""
    skeleton = _NUMBER.split(texts[0])
    columns = list(zip(*(_NUMBER.findall(t) for t in texts), strict=True))
    merged = []
    for column in columns:
        values = sorted(set(column), key=lambda s: float(s.replace(",", "")))
        merged.append(values[0] if len(values) == 1 else f"{values[0]}–{values[-1]}")
    out = skeleton[0]
    for number, rest in zip(merged, skeleton[1:], strict=True):
        out += number + rest
    return out


def _say(template: str, gpus: tuple[int, ...]) -> str:
    if not gpus:
        return template
    who = gpu_list(gpus)
    text = template.replace(_INDEX, ",".join(map(str, gpus)))  # nvidia-smi -i takes a list: `-i 0,1,2`
    if len(gpus) > 1:
        if text.startswith(_SUBJECT + "'s "):
            rest = text[len(_SUBJECT) + 3:]
            text = f"On {who}, the {rest}"
        elif text.startswith(_SUBJECT + " "):
            text = f"Each of {who}" + text[len(_SUBJECT):]
    return text.replace(_SUBJECT, who)


def reasons(findings: Iterable[dict]) -> list[Reason]:
    """The run's findings (as stored: dicts with severity, code, message, gpu_index), each said once: rejections
    first, then in the order the policy found them."""
    groups: dict[tuple, dict] = {}
    for f in findings:
        index = f.get("gpu_index")
        template = _template(f.get("message", ""), index)
        key = (f.get("severity", ""), f.get("code", ""), tuple(_NUMBER.split(template)), index is None)
        group = groups.setdefault(key, {"gpus": [], "texts": []})
        if index is not None and index not in group["gpus"]:
            group["gpus"].append(index)
        if template not in group["texts"]:
            group["texts"].append(template)
    said = []
    for (severity, code, _, whole), group in groups.items():
        gpus = tuple(sorted(group["gpus"]))
        text = _merge_numbers(group["texts"])
        said.append(Reason(severity, code, () if whole else gpus, _say(text, gpus)))
    return sorted(said, key=lambda r: r.severity != REJECT)  # stable: the policy's order within a severity


def reasons_text(findings: Iterable[dict], severity: str | None = None) -> str:
    """The reasons as one paragraph (a node's last error, an event), each said once."""
    return " ".join(r.text for r in reasons(findings) if severity is None or r.severity == severity)


# ------------------------------------------------------------------------ what the figures do match

# The figures compared with every catalogue model's datasheet: each is measured at about this share of it on a
# healthy card (tolerances.TOLERANCES' bands; gpus.md: BF16 80-87 %, device copies 75-90 %, SGEMM 0.70-0.78 on GDDR
# cards). FP16 and TF32 are left out: their datasheet figures mean different things on GeForce cards.
HEALTHY_SHARE = {"bf16_tflops": 0.83, "fp32_tflops": 0.78, "memory_bandwidth_gbs": 0.83}
POSITIVE_MAX = 1e15  # past any figure, SM count or MiB a card has; an int past 1e308 has no float quotient
FIGURE_NAMES = {"bf16_tflops": "BF16", "fp32_tflops": "FP32", "memory_bandwidth_gbs": "memory bandwidth"}


@dataclass(frozen=True)
class Match:
    """The catalogue model whose datasheet the measured figures fit best."""

    model: DeclaredModel
    declared: bool  # the model the provider declared
    shares: dict  # figure -> measured median / this model's datasheet
    sm_count: int | None  # measured streaming multiprocessors (the median over the GPUs)
    text: str


def _distance(model: DeclaredModel, median: dict, sm_count: int | None, memory_mib: int | None) -> float | None:
    terms = []
    for key, healthy in HEALTHY_SHARE.items():
        sheet, value = model.datasheet.get(key), median.get(key)
        if sheet and value:
            terms.append(math.log(value / (sheet * healthy)) ** 2)
    if not terms:
        return None
    if sm_count and model.sm_count:
        terms.append(4 * math.log(sm_count / model.sm_count) ** 2)  # counted exactly: it weighs more
    if memory_mib:
        least, most = model.memory_sizes(None)
        if not 0.99 * least <= memory_mib <= 1.01 * most:
            terms.append(math.log(memory_mib / most) ** 2)
    return statistics.fmean(terms)


def _positive(value: object) -> bool:
    """A finite number above zero and below POSITIVE_MAX (not a bool, a string or NaN): what a figure must be to be
    compared. Compared, not passed to math.isfinite: an int past the double's range (10**400) made it raise
    OverflowError, and a quotient of one raised in _distance (found by review)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= POSITIVE_MAX


def _as_dict(value: object) -> dict:
    return value if isinstance(value, dict) else {}


def _dicts(value: object) -> list[dict]:
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def closest_model(catalogue: Sequence[DeclaredModel], declared_slug: str, figures: dict,
                  inventory: dict | None = None) -> Match | None:
    """The catalogue model the run's measured medians (figures["median"]), streaming multiprocessors and memory
    fit best; None when nothing was measured."""
    # What a run stored is read as stored: a run recorded before the agent's answers were checked
    # (answers.py) may hold a string or NaN anywhere, and a page must not fail on it.
    figures = figures if isinstance(figures, dict) else {}
    median = {k: v for k, v in (_as_dict(figures.get("median"))).items() if _positive(v)}
    sms = [g["sm_count"] for g in _dicts(figures.get("gpus")) if _positive(g.get("sm_count"))]
    sm_count = int(statistics.median(sms)) if sms else None
    memories = [g["memory_total_mib"] for g in _dicts(_as_dict(inventory).get("gpus"))
                if _positive(g.get("memory_total_mib"))]
    memory_mib = int(statistics.median(memories)) if memories else None
    scored = [(d, m) for m in catalogue if (d := _distance(m, median, sm_count, memory_mib)) is not None]
    if not scored:
        return None
    _, best = min(scored, key=lambda pair: pair[0])
    shares = {k: median[k] / best.datasheet[k] for k in HEALTHY_SHARE if median.get(k) and best.datasheet.get(k)}
    said = ", ".join(f"{FIGURE_NAMES[k]} {share:.0%}" for k, share in shares.items())
    declared = best.slug == declared_slug
    text = (f"The measured figures fit {with_article(best.label)} best"
            f"{' (the model declared)' if declared else ', not the model declared'}: {said} of its datasheet")
    if sm_count and best.sm_count:
        text += (f", and {sm_count} streaming multiprocessors, as it has" if sm_count == best.sm_count
                 else f", and {sm_count} streaming multiprocessors (it has {best.sm_count})")
    text += "."
    return Match(best, declared, shares, sm_count, text)
