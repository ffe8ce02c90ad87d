"""The acceptance policy, rule by rule: pure functions on the catalogue's JSON and plain dicts (no database)."""
import copy

import pytest

from provisioning.verification.identity import check_identity
from provisioning.verification.model import DEGRADE, REJECT, DeclaredModel, Finding, load_catalogue
from provisioning.verification.pci_ids import PCI_DEVICE_IDS
from provisioning.verification.performance import FleetReference, check_performance
from provisioning.verification.policy import gpu_score, judge, node_score, verdict_for
from provisioning.verification.profiles import judge_profile, profile_expectation, profile_fleet, profile_names
from provisioning.verification.tolerances import FIGURES, TOLERANCES

CATALOGUE = load_catalogue()


def model(slug="a100-80gb-sxm"):
    return DeclaredModel.from_catalogue(CATALOGUE[slug])


def smi_gpu(index=0, slug="a100-80gb-sxm", **overrides):
    """An inventory GPU (nvidia-smi) exactly as the catalogue's card reports it."""
    entry = CATALOGUE[slug]
    hbm = entry["memory_type"].startswith("HBM")
    gpu = {"index": index, "uuid": f"GPU-{index:08d}", "name": entry["smi_name"],
           "memory_total_mib": entry["memory_mib_ecc_on" if hbm else "memory_mib_ecc_off"],
           "pci_bus_id": f"00000000:{index + 1:02X}:00.0",
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
    assert "`nvidia-smi -i 0 -pl 400`" in findings[0].message


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
    reject, degrade = Finding(REJECT, "x", "x"), Finding(DEGRADE, "y", "y")
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
    assert honest >= {"a100-80gb-sxm-x4", "rtx-a6000-x8", "rtx-a4000-x2", "h100-sxm-x1", "h200-sxm-x1",
                      "l40s-x4-ecc-off", "a10-x2"}
    caught = {code for e in expectations.values() for code in e["findings"]}
    assert caught >= {"bf16_low", "mig_enabled", "power_capped", "pcie_width", "host_link_slow", "clock_slowdown",
                      "gpu_outlier", "wrong_results", "below_fleet_median", "memory_mismatch_cuda_nvml"}
    fleets = {n: e["fleet"]["profile"] for n, e in expectations.items() if e.get("fleet")}
    assert fleets and all(expectations[f]["verdict"] == "verified" for f in fleets.values())


def test_degraded_nodes_score_lower_than_their_honest_twins():
    honest = judge_profile("a100-80gb-sxm-x4", CATALOGUE).score
    for name in ("a100-80gb-sxm-x4-power-capped", "a100-80gb-sxm-x4-thermal"):
        assert judge_profile(name, CATALOGUE).score < 0.8 * honest


def test_profile_fixture_helpers_are_not_shared_state():
    a, b = bench_gpu(), bench_gpu()
    a["telemetry"]["clocks_event_reasons"].append("HwSlowdown")
    assert b["telemetry"]["clocks_event_reasons"] == [] and copy.deepcopy(a) == a


# ------------------------------------------------------------------- memory sizes, power, the fleet (issue 11)

GDDR_WITH_ECC = ("rtx-a4000", "rtx-a5000", "rtx-a6000", "a10", "l4", "l40s", "rtx-4090")


def test_the_catalogue_knows_both_ecc_sizes_of_every_model():
    for slug, entry in CATALOGUE.items():
        on, off = entry["memory_mib_ecc_on"], entry["memory_mib_ecc_off"]
        assert entry["memory_mib"] in (on, off), slug  # the listed size is one of the two
        if slug in GDDR_WITH_ECC:  # in-band ECC takes 1/16 of GDDR6 memory
            assert abs(on - off * 15 / 16) < 2, slug
        else:  # HBM keeps ECC beside the data; the RTX 3090 has no ECC
            assert on == off, slug
    # gpus.md's figures (the sizes with the card's usual mode) are kept where gpus.md gives them
    assert (CATALOGUE["l40s"]["memory_mib_ecc_on"], CATALOGUE["a10"]["memory_mib_ecc_on"],
            CATALOGUE["l4"]["memory_mib_ecc_on"], CATALOGUE["rtx-a6000"]["memory_mib_ecc_off"]) == (
        46068, 23028, 23034, 49140)


@pytest.mark.parametrize("slug", ["l40s", "a10", "l4"])
def test_a_data_centre_card_with_ecc_off_is_not_rejected_for_its_whole_memory(slug):
    entry, declared = CATALOGUE[slug], model(slug)
    ecc_off = smi_gpu(slug=slug, ecc_mode="Disabled", memory_total_mib=entry["memory_mib_ecc_off"])
    ecc_on = smi_gpu(slug=slug, ecc_mode="Enabled", memory_total_mib=entry["memory_mib_ecc_on"])
    assert check_identity(declared, 1, [ecc_off]) == check_identity(declared, 1, [ecc_on]) == []
    # its ECC mode unknown ([N/A]): either size
    assert check_identity(declared, 1, [dict(ecc_off, ecc_mode=None)]) == []
    assert check_identity(declared, 1, [dict(ecc_on, ecc_mode=None)]) == []
    # the ECC-off size while ECC is on is more than the card has in that mode
    found = check_identity(declared, 1, [dict(ecc_on, memory_total_mib=entry["memory_mib_ecc_off"])])
    assert codes(found) == {("memory_larger_than_model", 0)}
    assert "with ECC on" in found[0].message and str(entry["memory_mib_ecc_on"]) in found[0].message


def test_memory_larger_or_smaller_than_the_model_is_rejected_with_its_own_code():
    larger = check_identity(model("a100-40gb-sxm"), 1, [smi_gpu(slug="a100-40gb-sxm", memory_total_mib=81920)])
    assert codes(larger) == {("memory_larger_than_model", 0)}
    assert "faked size" in larger[0].message
    smaller = check_identity(model(), 1, [smi_gpu(memory_total_mib=40960)])
    assert codes(smaller) == {("gpu_memory", 0)}


def test_cuda_total_memory_is_compared_with_nvml_and_the_catalogue():
    inventory = [smi_gpu()]
    # CUDA sees a little less than NVML (what the driver reserves): fine
    assert check_performance(model(), bench(bench_gpu(memory_mib=81920 - 870)), inventory) == []
    # a shim that hooks NVML but not CUDA (or the other way round)
    found = check_performance(model(), bench(bench_gpu(memory_mib=40536)), inventory)
    assert codes(found) == {("memory_mismatch_cuda_nvml", 0)}
    assert "40536 MiB" in found[0].message and "81920 MiB" in found[0].message and "driver" in found[0].message
    found = check_performance(model(), bench(bench_gpu(memory_mib=90000)), [smi_gpu(memory_total_mib=81920)])
    assert codes(found) == {("memory_mismatch_cuda_nvml", 0), ("memory_larger_than_model", 0)}
    # a 40 GB card whose shim says 80 GB to NVML and CUDA alike agrees everywhere: left to the memory proof
    assert check_performance(model(), bench(bench_gpu(memory_mib=81920)), inventory) == []
    # the CPU benchmark (tests) has no CUDA memory to compare
    assert check_performance(model(), bench(bench_gpu(memory_mib=None)), inventory) == []


def test_a_card_pinned_under_its_tdp_is_power_capped_whatever_limit_it_reports():
    inventory = [smi_gpu()]  # reports 400 W of 400 W
    capped = bench_gpu(telemetry={"power_draw_w": 300.0, "clocks_event_reasons": ["SwPowerCap"]})
    found = check_performance(model(), bench(capped), inventory)
    assert codes(found, DEGRADE) == {("power_capped", 0)}
    assert "300 W" in found[0].message and "reports a power limit of 400 W" in found[0].message
    # at its TDP with SwPowerCap: a card using all it may (normal under full load)
    at_tdp = bench_gpu(telemetry={"power_draw_w": 395.0, "clocks_event_reasons": ["SwPowerCap"]})
    assert check_performance(model(), bench(at_tdp), inventory) == []
    # drawing little without the power cap acting: not capped (the load did not need more)
    light = bench_gpu(telemetry={"power_draw_w": 250.0, "clocks_event_reasons": []})
    assert check_performance(model(), bench(light), inventory) == []
    edge = TOLERANCES["power_capped_draw_max_fraction"] * 400
    assert check_performance(model(), bench(bench_gpu(telemetry={
        "power_draw_w": edge, "clocks_event_reasons": ["SwPowerCap"]})), inventory) == []


def test_a_reported_limit_under_the_models_tdp_is_capped_even_when_the_default_says_so_too():
    found = check_identity(model(), 1, [smi_gpu(power_limit_w=300.0, power_default_limit_w=300.0)])
    assert codes(found, DEGRADE) == {("power_capped", 0)}
    assert "TDP (400 W)" in found[0].message


def fleet_of(values: dict, nodes=6, spread=0.01):
    """Per-node medians of `nodes` nodes around `values` (each node a little off: +/- spread)."""
    return FleetReference.from_node_medians(
        [{k: v * (1 + spread * ((n % 3) - 1)) for k, v in values.items()} for n in range(nodes)])


def test_the_fleet_reference_is_a_median_and_mad_over_nodes():
    ref = FleetReference.from_node_medians([{"bf16_tflops": v} for v in (100, 102, 98, 101, 99, 60)])
    assert ref.nodes == 6 and ref.median["bf16_tflops"] == 99.5 and ref.mad["bf16_tflops"] == 1.5
    gap = TOLERANCES["fleet_max_gap"]["bf16_tflops"]
    assert ref.floor("bf16_tflops") == pytest.approx(99.5 * (1 - gap))  # the gap, wider than 4 sigma here
    assert "fp32_tflops" not in ref.median and ref.floor("fp32_tflops") is None
    wide = FleetReference.from_node_medians([{"bf16_tflops": v} for v in (70, 85, 100, 115, 130)])
    assert wide.floor("bf16_tflops") == pytest.approx(100 - 4 * 1.4826 * 15)  # a wide fleet widens its floor


def test_a_gpu_clearly_below_its_models_fleet_is_degraded_with_its_own_code():
    fast = bench_gpu(0)
    fleet = fleet_of({k: fast[k] for k in TOLERANCES["fleet_max_gap"] if k in fast})
    assert check_performance(model(), bench(fast, bench_gpu(1)), [smi_gpu(0), smi_gpu(1)], fleet) == []
    slow = bench_gpu(1, share={"bf16_tflops": 0.70})  # inside the datasheet band (0.65), 18 % under the fleet
    assert check_performance(model(), bench(slow), [smi_gpu(1)]) == []
    found = check_performance(model(), bench(slow), [smi_gpu(1)], fleet)
    assert codes(found) == {("below_fleet_median", 1)}
    assert "BF16 matmul" in found[0].message and "18 % under" not in found[0].message
    assert "18% under the fleet" in found[0].message and "6 other A100 80GB SXM nodes" in found[0].message
    near = bench_gpu(1, share={"bf16_tflops": 0.85 * 0.93})  # 7 % under: within the fleet's spread
    assert check_performance(model(), bench(near), [smi_gpu(1)], fleet) == []


def test_the_platforms_own_challenge_rate_is_kept_and_judged_against_the_fleet():
    """The agent's figures are the node's word: a shim reported an honest A10's while the cards did 68 % on the
    platform's clock, inside every datasheet band, and the fleet compared only the reported figures (found by
    review). The rate the challenge measured is kept per GPU and in the run's medians, and judged like them."""
    from provisioning.verification.challenge_verdict import platform_rates

    honest = bench_gpu(0)
    fleet = fleet_of({**{k: honest[k] for k in TOLERANCES["fleet_max_gap"] if k in honest},
                      "platform_bf16_tflops": 250.0})
    gpus = [smi_gpu(0), smi_gpu(1)]
    shimmed = bench(bench_gpu(0), bench_gpu(1))  # reports honest figures for both
    rates = platform_rates({"gpus": {"0": {"bf16_tflops": 248.0, "correct": True},
                                     "1": {"bf16_tflops": 205.0, "correct": True},  # 18 % under the fleet's
                                     "2": {"bf16_tflops": 999.0, "correct": False}}})  # wrong: not a rate
    assert rates == {0: 248.0, 1: 205.0}
    result = judge(model(), 2, gpus, shimmed, fleet=fleet, platform_rates=rates)
    assert codes(result.findings) == {("below_fleet_median", 1)}
    assert "BF16 of the platform's challenge, timed by the platform 205" in result.findings[0].message
    assert [g["platform_bf16_tflops"] for g in result.figures["gpus"]] == [248.0, 205.0]
    assert result.figures["median"]["platform_bf16_tflops"] == 226.5  # what the next node's fleet reads
    assert codes(judge(model(), 2, gpus, shimmed, fleet=fleet).findings) == set()  # the reported figures alone


def test_the_cnn_workload_is_judged_against_the_fleet():
    fleet = fleet_of({"cnn_train_images_s": 90000.0, "cnn_infer_images_s": 300000.0})
    found = check_performance(model(), bench(bench_gpu(cnn_train_images_s=60000.0)), [smi_gpu()], fleet)
    assert codes(found) == {("below_fleet_median", 0)} and "small-CNN training" in found[0].message
    assert check_performance(model(), bench(bench_gpu()), [smi_gpu()], fleet) == []
    # the launch-bound CNN gets a wider gap than the matmuls: 12 % under is within it
    assert check_performance(model(), bench(bench_gpu(cnn_train_images_s=90000.0 * 0.88)), [smi_gpu()], fleet) == []


def test_judge_keeps_the_fleet_it_compared_with_and_the_cpu_benchmark_is_not_compared():
    gpu = bench_gpu()
    fleet = fleet_of({"bf16_tflops": gpu["bf16_tflops"] * 1.5})
    result = judge(model(), 1, [smi_gpu()], bench(gpu), fleet=fleet)
    assert result.verdict == "degraded" and result.figures["fleet"]["nodes"] == 6
    assert result.figures["fleet"]["median"]["bf16_tflops"] == pytest.approx(gpu["bf16_tflops"] * 1.5, rel=1e-3)
    assert "fleet" not in judge(model(), 1, [smi_gpu()], bench(gpu)).figures
    on_cpu = check_performance(model(), bench(gpu, device="cpu"), [smi_gpu()], fleet)
    assert "below_fleet_median" not in {f.code for f in on_cpu}


def test_the_slow_impostor_passes_the_datasheet_bands_and_only_the_fleet_catches_it():
    for _ in range(20):
        alone = judge_profile("slow-card-posing-as-a10-x2", CATALOGUE, fleet=False)
        assert alone.verdict == "verified", [f.message for f in alone.findings]  # the miss the issue describes
        # against six honest A10 nodes, drawn afresh each round (what fleet=True draws)
        fleet = profile_fleet("slow-card-posing-as-a10-x2", CATALOGUE)
        caught = judge_profile("slow-card-posing-as-a10-x2", CATALOGUE, fleet=fleet)
        assert (caught.verdict, {f.code for f in caught.findings}) == ("degraded", {"below_fleet_median"})
        # and the honest A10 judged against that same fleet stays verified: still a fresh fleet each of the twenty
        # rounds, without six more honest runs a round for a fleet of its own
        assert judge_profile("a10-x2", CATALOGUE, fleet=fleet).verdict == "verified"


def test_the_hidden_power_cap_and_ecc_off_profiles_turn_on_the_new_rules_only():
    capped = judge_profile("a100-80gb-sxm-x2-hidden-power-cap", CATALOGUE)
    assert {f.code for f in capped.findings} == {"power_capped"}  # every datasheet band passes
    assert "reports a power limit of 400 W" in capped.findings[0].message
    assert judge_profile("l40s-x4-ecc-off", CATALOGUE).findings == []


# ------------------------------------------------------------------------------------ performance per watt

def test_the_summary_keeps_bf16_per_watt_drawn_under_load_per_gpu_and_its_median():
    gpus = [bench_gpu(0, telemetry={"power_draw_w": 400.0}), bench_gpu(1, telemetry={"power_draw_w": 300.0}),
            bench_gpu(2, telemetry={"power_draw_w": 350.0})]
    figures = judge(model(), 3, [smi_gpu(i) for i in range(3)], bench(*gpus)).figures
    bf16 = 312 * 0.85
    rows = {g["index"]: g for g in figures["gpus"]}
    assert rows[0]["power_draw_w"] == 400.0
    assert rows[0]["bf16_tflops_per_w"] == pytest.approx(bf16 / 400, rel=1e-4)
    assert rows[1]["bf16_tflops_per_w"] == pytest.approx(bf16 / 300, rel=1e-4)
    assert figures["median"]["bf16_tflops_per_w"] == pytest.approx(bf16 / 350, rel=1e-4)
    assert figures["median"]["power_draw_w"] == 350.0


@pytest.mark.parametrize("telemetry", [{"power_draw_w": None}, {"power_draw_w": 0.0}])
def test_no_power_reading_means_no_per_watt_figure_rather_than_a_guess(telemetry):
    figures = judge(model(), 1, [smi_gpu()], bench(bench_gpu(telemetry=telemetry))).figures
    assert figures["gpus"][0]["bf16_tflops_per_w"] is None and figures["median"]["bf16_tflops_per_w"] is None


def test_a_cpu_run_has_no_per_watt_figure():
    figures = judge(model(), 1, [smi_gpu()], bench(bench_gpu(), device="cpu")).figures
    assert "bf16_tflops_per_w" not in figures["gpus"][0] and figures["median"]["bf16_tflops_per_w"] is None
