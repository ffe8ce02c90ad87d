"""One GPU UUID reported by several cards of a server (`gpu_uuid_repeated`). Its finding named the first card only
(`gpu_index`): the provider's node page listed the rejection as "gpu_uuid_repeated (GPU 0)", the API's finding said
GPU 0 was the card concerned, while GPU 2 reported the same UUID. Now the finding is made for every card carrying
the UUID, each with its own index, and said once with all of them."""
from provisioning.verification.identity import check_identity
from provisioning.verification.model import DeclaredModel, load_catalogue
from provisioning.verification.wording import reasons

NAME = "NVIDIA A100-SXM4-80GB"


def _gpus(*uuids: str) -> list[dict]:
    return [{"index": i, "uuid": u, "name": NAME, "memory_total_mib": 81920} for i, u in enumerate(uuids)]


def _repeated(*uuids: str) -> list[dict]:
    declared = DeclaredModel.from_catalogue(load_catalogue()["a100-80gb-sxm"])
    return [f.as_dict() for f in check_identity(declared, len(uuids), _gpus(*uuids)) if f.code == "gpu_uuid_repeated"]


def test_every_card_reporting_a_repeated_uuid_is_named_by_the_finding():
    findings = _repeated("GPU-a", "GPU-b", "GPU-a", "GPU-c")
    assert sorted(f["gpu_index"] for f in findings) == [0, 2]
    assert {f["severity"] for f in findings} == {"reject"}
    said = [r for r in reasons(findings) if r.code == "gpu_uuid_repeated"]
    assert len(said) == 1  # said once, naming both cards
    assert said[0].gpus == (0, 2) and said[0].gpus_text == "GPUs 0 and 2"
    assert said[0].text.startswith("GPUs 0, 2 report the same UUID GPU-a;")


def test_two_repeated_uuids_each_name_their_own_cards():
    findings = _repeated("GPU-a", "GPU-b", "GPU-a", "GPU-b", "GPU-c")
    assert sorted((f["gpu_index"], f["message"].split(" report")[0]) for f in findings) == [
        (0, "GPUs 0, 2"), (1, "GPUs 1, 3"), (2, "GPUs 0, 2"), (3, "GPUs 1, 3")]
