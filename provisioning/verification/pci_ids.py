"""PCI device ids of the catalogue's models (vendor 0x10de, NVIDIA), keyed by catalogue slug.

Source: the PCI ID Repository (pci.ids), checked against Debian's `pci.ids` package 0.0~2023.04.11 and the
upstream pciutils/pciids file (L40S 26b9 and H200 SXM 2335 are only in the newer one). Lines used, e.g.
`20b2  GA100 [A100 SXM4 80GB]`, `2230  GA102GL [RTX A6000]`, `2335  GH100 [H200 SXM 141GB]`.
nvidia-smi prints `pci.device_id` as 0xDDDDVVVV (device id, then vendor id): 0x20B210DE is an A100 SXM4 80GB.

Kept here, not in the catalogue (marketplace/data/gpu_models.json), until the catalogue carries the field.
"""
from __future__ import annotations

NVIDIA_VENDOR_ID = 0x10DE

PCI_DEVICE_IDS: dict[str, tuple[int, ...]] = {
    "rtx-a4000": (0x24B0,),
    "rtx-a5000": (0x2231,),
    "rtx-a6000": (0x2230,),
    "a100-40gb-pcie": (0x20B1, 0x20F1),  # pci.ids lists both as "A100 PCIe 40GB"
    "a100-40gb-sxm": (0x20B0,),
    "a100-80gb-pcie": (0x20B5,),
    "a100-80gb-sxm": (0x20B2,),
    "a10": (0x2236,),
    "l4": (0x27B8,),
    "l40s": (0x26B9,),
    "rtx-3090": (0x2204,),
    "rtx-4090": (0x2684,),
    "h100-pcie": (0x2331,),
    "h100-sxm": (0x2330,),
    "h200-sxm": (0x2335,),
}
_BY_ID = {device: slug for slug, ids in PCI_DEVICE_IDS.items() for device in ids}


def parse_device_id(raw: str | None) -> tuple[int, int] | None:
    """nvidia-smi's '0x20B210DE' -> (device 0x20b2, vendor 0x10de); None if unreadable."""
    try:
        value = int(str(raw), 16)
    except ValueError:
        return None
    return value >> 16, value & 0xFFFF


def slug_for_device_id(device: int) -> str | None:
    return _BY_ID.get(device)
