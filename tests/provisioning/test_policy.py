"""The acceptance policy, rule by rule: pure functions on the catalogue's JSON and plain dicts (no database)."""
import copy

import pytest

from provisioning.verification import policy
from provisioning.verification.pci_ids import PCI_DEVICE_IDS
from provisioning.verification.policy import (
    DEGRADE,
    FIGURES,
    REJECT,
    TOLERANCES,
    DeclaredModel,
    check_identity,
    check_performance,
    gpu_score,
    judge,
    load_catalogue,
    node_score,
    verdict_for,
)
from provisioning.verification.profiles import judge_profile, profile_expectation, profile_names

CATALOGUE = load_catalogue()


def model(slug="a100-80gb-sxm"):
    return DeclaredModel.from_catalogue(CATALOGUE[slug])


def smi_gpu(index=0, slug="a100-80gb-sxm", **overrides):
    """An inventory GPU (nvidia-smi) exactly as the catalogue's card reports it."""
    entry = CATALOGUE[slug]
    hbm = entry["memory_type"].startswith("HBM")
    gpu = {"index": index, "uuid": f"GPU-{index:08d}", "name": entry["smi_name"],
           "memory_total_mib": entry["memory_mib"], "pci_bus_id": f"00000000:{index + 1:02X}:00.0",
           "pci_device_id": f"0x{PCI_DEVICE_IDS[slug][0]:04X}10DE",
           "pcie_link_gen_max": entry["pcie_gen"], "pcie_link_gen_current": entry["pcie_gen"],
           "pcie_link_width_max": 16, "pcie_link_width_current": 16, "power_limit_w": float(entry["tdp_w"]),
           "power_default_limit_w": float(entry["tdp_w"]),
           "mig_mode": "Disabled" if entry["mig_max_instances"] else None,
           "ecc_mode": "Enabled" if hbm else "Disabled", "driver_version": "550.90.07"}
    gpu.update(overrides)
    return gpu


HEALTHY = {"bf16_tflops": 0.85, "fp16_tflops": 0.85, "tf32_tflops": 0.8, "fp32_tflops": 0.85,
           "memory_bandwidth_gbs": 0.85}
HOST_LINK = {3: 12.0, 4: 25.0, 5: 55.0}


def bench_gpu(index=0, slug="a100-80gb-sxm", share=None, telemetry=None, **overrides):
    """A benchmark GPU as a healthy card measures: `share` of each datasheet figure."""
    entry, declared = CATALOGUE[slug], model(slug)
    gpu = {"index": index, "uuid": f"GPU-{index:08d}", "name": entry["smi_name"], "memory_mib": entry["memory_mib"],
           "sm_count": declared.sm_count, "h2d_gbs": HOST_LINK[entry["pcie_gen"]],
           "d2h_gbs": HOST_LINK[entry["pcie_gen"]], "cnn_train_images_s": 90000.0, "cnn_infer_images_s": 300000.0,
           "matmul_rel_error": {"fp32": 2e-7, "bf16": 3e-3},
           "telemetry": {"samples": 40, "sm_clock_mhz": 1400.0, "sm_clock_max_mhz": 1410.0, "power_draw_w": 380.0,
                         "temperature_c": 65.0, "clocks_event_reasons": [], "pcie_link_gen": entry["pcie_gen"],
                         "pcie_link_width": 16, "error": None}}
    for key, ratio in {**HEALTHY, **(share or {})}.items():
        gpu[key] = round(declared.datasheet[key] * ratio, 3)
    gpu["telemetry"].update(telemetry or {})
    gpu.update(overrides)
    return gpu


def bench(*gpus, device="cuda"):
    return {"mode": "measured", "device": device, "quick": False, "gpus": list(gpus)}


def codes(findings, severity=None):
    return {(f.code, f.gpu_index) for f in findings if severity is None or f.severity == severity}


# --------------------------------------------------------------------------------------------- identity

def test_a_healthy_node_has_no_findings():
    gpus = [smi_gpu(i) for i in range(4)]
    assert check_identity(model(), 4, gpus) == []
    assert check_performance(model(), bench(*[bench_gpu(i) for i in range(4)]), gpus) == []


def test_gpu_count_must_match_the_declaration():
    assert codes(check_identity(model(), 4, [smi_gpu(0), smi_gpu(1)]), REJECT) == {("gpu_count", None)}


@pytest.mark.parametrize("overrides", [{"name": "NVIDIA A100-SXM4-80GB MIG 1g.10gb", "memory_total_mib": 9728},
                                       {"mig_mode": "Enabled"}])
def test_mig_slices_and_mig_mode_are_rejected(overrides):
    findings = check_identity(model(), 1, [smi_gpu(**overrides)])
    assert ("mig_enabled", 0) in codes(findings, REJECT)
    assert "nvidia-smi -mig 0" in next(f.message for f in findings if f.code == "mig_enabled")


def test_another_name_is_rejected():
    findings = check_identity(model(), 1, [smi_gpu(name="NVIDIA RTX A6000")])
    assert ("gpu_name", 0) in codes(findings, REJECT)


def test_memory_must_match_with_room_for_ecc_on_gddr_only():
    assert check_identity(model(), 1, [smi_gpu(memory_total_mib=81920 - 500)]) == []  # within 1 %
    assert codes(check_identity(model(), 1, [smi_gpu(memory_total_mib=40960)])) == {("gpu_memory", 0)}
    a6000 = model("rtx-a6000")
    ecc_on = smi_gpu(slug="rtx-a6000", ecc_mode="Enabled", memory_total_mib=int(49140 * 0.94))
    assert check_identity(a6000, 1, [ecc_on]) == []  # GDDR6 gives part of its memory to ECC
    assert codes(check_identity(model(), 1, [smi_gpu(memory_total_mib=int(81920 * 0.94))])) == {("gpu_memory", 0)}


def test_a_power_limit_under_95_percent_of_default_degrades():
    assert check_identity(model(), 1, [smi_gpu(power_limit_w=380.0)]) == []  # exactly 95 %
    findings = check_identity(model(), 1, [smi_gpu(power_limit_w=250.0)])
    assert codes(findings, DEGRADE) == {("power_capped", 0)}
    assert "nvidia-smi -pl" in findings[0].message


def test_a_narrow_link_degrades():
    assert codes(check_identity(model(), 1, [smi_gpu(pcie_link_width_max=4)]), DEGRADE) == {("pcie_width", 0)}


def test_pci_device_id_of_another_model_rejects_an_unknown_one_says_nothing():
    a6000_id = f"0x{PCI_DEVICE_IDS['rtx-a6000'][0]:04X}10DE"
    findings = check_identity(model(), 1, [smi_gpu(pci_device_id=a6000_id)])
    assert codes(findings, REJECT) == {("pci_device_id", 0)} and "rtx-a6000" in findings[0].message
    assert check_identity(model(), 1, [smi_gpu(pci_device_id="0x20B310DE")]) == []  # an A100 variant not listed
    assert codes(check_identity(model(), 1, [smi_gpu(pci_device_id="0x20B21002")])) == {("pci_device_id", 0)}
    both = [smi_gpu(0, "a100-40gb-pcie", pci_device_id="0x20B110DE"), smi_gpu(1, "a100-40gb-pcie",
                                                                              pci_device_id="0x20F110DE")]
    assert check_identity(model("a100-40gb-pcie"), 2, both) == []


def test_every_catalogue_model_has_pci_ids_and_an_sm_count():
    assert set(PCI_DEVICE_IDS) == set(CATALOGUE)
    assert {slug: model(slug).sm_count for slug in ("a100-80gb-sxm", "rtx-a6000", "rtx-a4000", "h100-sxm",
                                                    "h200-sxm")} == {
        "a100-80gb-sxm": 108, "rtx-a6000": 84, "rtx-a4000": 48, "h100-sxm": 132, "h200-sxm": 132}
    h200 = model("h200-sxm")
    assert (h200.smi_name, h200.memory_mib, h200.pcie_gen, h200.datasheet["bf16_tflops"]) == (
        "NVIDIA H200", 143771, 5, 989.0)


# ------------------------------------------------------------------------------------ measured figures

BANDS = TOLERANCES["figure_bands"]


@pytest.mark.parametrize("key", list(FIGURES))
def test_each_figure_has_a_band_of_its_datasheet_figure(key):
    code, band = key.rsplit("_", 1)[0], BANDS[key]
    judged = {}
    for label, ratio in {"inside": band["degrade"] + 0.01, "degrade": band["degrade"] - 0.01,
                         "reject": band["reject"] - 0.01, "above": (band["max"] or 9) + 0.02}.items():
        judged[label] = codes(check_performance(model(), bench(bench_gpu(share={key: ratio}))))
    assert judged["inside"] == set()
    assert judged["degrade"] == {(f"{code}_low", 0)}
    assert judged["reject"] == {(f"{code}_low", 0)}
    if band["max"] is None:  # FP16 and TF32 have no upper bound (FP16 accumulate, GeForce TF32 = FP32 figure)
        assert judged["above"] == set()
    else:
        assert judged["above"] == {(f"{code}_too_high", 0)}
    findings = check_performance(model(), bench(bench_gpu(share={key: band["reject"] - 0.01})))
    assert findings[0].severity == REJECT
    findings = check_performance(model(), bench(bench_gpu(share={key: band["degrade"] - 0.01})))
    assert findings[0].severity == DEGRADE and "rated for" in findings[0].message


def test_figures_the_catalogue_derives_get_lower_floors():
    # RTX A4000: "TF32 and BF16 derived from cores x clock" -> BF16/FP16/TF32 floors x 0.9; FP32 is a datasheet line.
    a4000 = model("rtx-a4000")
    assert a4000.derived == {"bf16_tflops", "fp16_tflops", "tf32_tflops"}
    low = {"bf16_tflops": 0.60, "fp16_tflops": 0.60, "tf32_tflops": 0.55}
    assert check_performance(a4000, bench(bench_gpu(slug="rtx-a4000", share=low))) == []
    a6000 = model("rtx-a6000")
    assert a6000.derived == frozenset()
    assert codes(check_performance(a6000, bench(bench_gpu(slug="rtx-a6000", share={"bf16_tflops": 0.60})))) == {
        ("bf16_low", 0)}


@pytest.mark.parametrize("slug", ["rtx-3090", "rtx-4090"])
def test_geforce_figures_are_not_false_rejections(slug):
    # Catalogue: BF16/FP16 with FP32 accumulate (what PyTorch measures); TF32 listed equal to FP32.
    declared = model(slug)
    assert declared.datasheet["tf32_tflops"] == declared.datasheet["fp32_tflops"]
    realistic = {"bf16_tflops": 0.8, "fp16_tflops": 1.9, "tf32_tflops": 1.3, "fp32_tflops": 0.7}
    gpu = bench_gpu(slug=slug, share=realistic, sm_count=declared.sm_count)
    assert check_performance(declared, bench(gpu)) == []


@pytest.mark.parametrize(("slug", "ok", "slow"), [("a100-80gb-sxm", 19.0, 17.0), ("h100-sxm", 41.0, 39.0)])
def test_host_link_minimum_depends_on_the_pcie_generation(slug, ok, slow):
    assert check_performance(model(slug), bench(bench_gpu(slug=slug, h2d_gbs=ok, d2h_gbs=ok))) == []
    findings = check_performance(model(slug), bench(bench_gpu(slug=slug, h2d_gbs=ok, d2h_gbs=slow)))
    assert codes(findings, DEGRADE) == {("host_link_slow", 0)}
    assert f"Gen{model(slug).pcie_gen} x16" in findings[0].message
    assert TOLERANCES["host_link_min_gbs"][model(slug).pcie_gen] in (18.0, 40.0)


def test_link_width_under_load_and_dedupe_with_the_identity_finding():
    tele = {"pcie_link_width": 4}
    assert codes(check_performance(model(), bench(bench_gpu(telemetry=tele)))) == {("pcie_width", 0)}
    result = judge(model(), 1, [smi_gpu(pcie_link_width_max=4)], bench(bench_gpu(telemetry=tele)))
    assert [f.code for f in result.findings] == ["pcie_width"]


def test_hardware_and_thermal_slowdowns_degrade_a_power_cap_under_load_does_not():
    normal = bench_gpu(telemetry={"clocks_event_reasons": ["SwPowerCap"]})
    assert check_performance(model(), bench(normal)) == []
    hot = bench_gpu(telemetry={"clocks_event_reasons": ["HwSlowdown", "HwThermalSlowdown"], "temperature_c": 94.0})
    findings = check_performance(model(), bench(hot))
    assert codes(findings, DEGRADE) == {("clock_slowdown", 0)} and "94 °C" in findings[0].message


def test_clocks_far_under_their_maximum_degrade():
    findings = check_performance(model(), bench(bench_gpu(telemetry={"sm_clock_mhz": 800.0})))
    assert codes(findings, DEGRADE) == {("low_clock", 0)}
    assert check_performance(model(), bench(bench_gpu(telemetry={"sm_clock_mhz": 900.0}))) == []  # 64 %


@pytest.mark.parametrize("errors", [{"fp32": 0.25, "bf16": 3e-3}, {"fp32": 2e-7, "bf16": 0.3},
                                    {"fp32": None, "bf16": 3e-3}, {}])
def test_wrong_or_missing_matmul_results_reject(errors):
    findings = check_performance(model(), bench(bench_gpu(matmul_rel_error=errors)))
    assert codes(findings, REJECT) == {("wrong_results", 0)}
    assert "take it out of service" in findings[0].message


def test_a_gpu_more_than_10_percent_under_the_node_median_degrades():
    gpus = [bench_gpu(i) for i in range(8)]
    gpus[5] = bench_gpu(5, share={"bf16_tflops": 0.85 * 0.85, "fp16_tflops": 0.85 * 0.85})
    gpus[2] = bench_gpu(2, share={"bf16_tflops": 0.85 * 0.92})  # 8 % under: healthy spread
    findings = check_performance(model(), bench(*gpus))
    assert codes(findings) == {("gpu_outlier", 5)}
    assert "15%" in findings[0].message


def test_the_tolerance_table_drives_the_rules(monkeypatch):
    gpus = [bench_gpu(i) for i in range(4)]
    gpus[3] = bench_gpu(3, share={"bf16_tflops": 0.85 * 0.85})
    assert codes(check_performance(model(), bench(*gpus))) == {("gpu_outlier", 3)}
    monkeypatch.setitem(TOLERANCES, "node_median_max_deviation", 0.2)
    assert check_performance(model(), bench(*gpus)) == []


def test_what_cuda_reports_must_match_nvidia_smi_and_the_catalogue():
    renamed = bench_gpu(name="NVIDIA RTX A6000")
    assert codes(check_performance(model(), bench(renamed), [smi_gpu()]), REJECT) == {("cuda_name", 0)}
    fewer_sms = bench_gpu(sm_count=84)
    assert codes(check_performance(model(), bench(fewer_sms), [smi_gpu()]), REJECT) == {("sm_count", 0)}
    cpu = bench_gpu(name="AMD EPYC", sm_count=None)
    assert check_performance(model(), bench(cpu, device="cpu"), [smi_gpu()]) == []


def test_a_missing_figure_is_an_incomplete_benchmark():
    gpu = bench_gpu()
    del gpu["tf32_tflops"]
    assert codes(check_performance(model(), bench(gpu)), REJECT) == {("benchmark_incomplete", 0)}


# ------------------------------------------------------------------------------------ verdict and score

def test_verdict_is_the_worst_finding():
    reject, degrade = policy.Finding(REJECT, "x", "x"), policy.Finding(DEGRADE, "y", "y")
    assert (verdict_for([]), verdict_for([degrade]), verdict_for([degrade, reject])) == (
        "verified", "degraded", "rejected")


def test_score_is_per_gpu_relative_to_the_reference_card():
    ref = TOLERANCES["score_reference"]
    at_datasheet = {"bf16_tflops": ref["bf16_tflops"], "memory_bandwidth_gbs": ref["memory_bandwidth_gbs"]}
    assert gpu_score(at_datasheet) == pytest.approx(100)
    h100 = {"bf16_tflops": 794.0, "memory_bandwidth_gbs": 2903.0}  # gpus.md's measured H100 SXM
    assert gpu_score(h100) == pytest.approx(100 * (794 / 312 * 2903 / 2039) ** 0.5)
    gpus = [at_datasheet, h100]
    assert node_score(gpus, "verified") == pytest.approx((100 + gpu_score(h100)) / 2, abs=0.01)
    assert node_score(gpus, "degraded") == pytest.approx(node_score(gpus, "verified") * 0.8, abs=0.01)
    assert node_score(gpus, "rejected") == 0
    assert node_score([], "verified") is None
    # Per GPU: four cards score what one does, so score_per_dollar compares per-GPU-hour prices fairly.
    assert node_score([h100] * 4, "verified") == node_score([h100], "verified")


def test_judge_combines_identity_benchmark_and_errors():
    gpus = [smi_gpu(i) for i in range(2)]
    healthy = judge(model(), 2, gpus, bench(bench_gpu(0), bench_gpu(1)))
    assert (healthy.verdict, healthy.findings) == ("verified", [])
    assert healthy.score == pytest.approx(100 * 0.85, abs=0.1)
    assert healthy.figures["gpus"][0]["of_datasheet"]["bf16_tflops"] == 0.85
    assert healthy.figures["median"]["bf16_tflops"] == pytest.approx(312 * 0.85, abs=0.01)
    no_torch = judge(model(), 2, gpus, None, "PyTorch is not installed")
    assert (no_torch.verdict, [f.code for f in no_torch.findings], no_torch.score) == (
        "rejected", ["benchmark_unavailable"], None)
    identity_only = judge(model(), 2, gpus, None)
    assert (identity_only.verdict, identity_only.score, identity_only.figures) == ("verified", None, {})


def test_findings_are_plain_dicts_for_the_database():
    finding = check_identity(model(), 1, [smi_gpu(power_limit_w=100.0)])[0]
    assert finding.as_dict() == {"severity": "degrade", "code": "power_capped", "message": finding.message,
                                 "gpu_index": 0}


# -------------------------------------------------------------------------------------- the sim profiles

@pytest.mark.parametrize("name", profile_names())
def test_every_profile_gets_its_expected_verdict_over_noisy_runs(name):
    expect = profile_expectation(name)
    for _ in range(25):
        result = judge_profile(name, CATALOGUE)
        seen = {f.code for f in result.findings}
        assert result.verdict == expect["verdict"], [f.message for f in result.findings]
        assert set(expect["findings"]) <= seen, seen
        if expect["verdict"] == "verified":
            assert result.score > 0
        elif expect["verdict"] == "rejected":
            assert result.score == 0


def test_the_profiles_cover_every_way_of_misreporting():
    expectations = {name: profile_expectation(name) for name in profile_names()}
    honest = {n for n, e in expectations.items() if e["verdict"] == "verified"}
    assert honest >= {"a100-80gb-sxm-x4", "rtx-a6000-x8", "rtx-a4000-x2", "h100-sxm-x1", "h200-sxm-x1"}
    caught = {code for e in expectations.values() for code in e["findings"]}
    assert caught >= {"bf16_low", "mig_enabled", "power_capped", "pcie_width", "host_link_slow", "clock_slowdown",
                      "gpu_outlier", "wrong_results"}


def test_degraded_nodes_score_lower_than_their_honest_twins():
    honest = judge_profile("a100-80gb-sxm-x4", CATALOGUE).score
    for name in ("a100-80gb-sxm-x4-power-capped", "a100-80gb-sxm-x4-thermal"):
        assert judge_profile(name, CATALOGUE).score < 0.8 * honest


def test_profile_fixture_helpers_are_not_shared_state():
    a, b = bench_gpu(), bench_gpu()
    a["telemetry"]["clocks_event_reasons"].append("HwSlowdown")
    assert b["telemetry"]["clocks_event_reasons"] == [] and copy.deepcopy(a) == a
