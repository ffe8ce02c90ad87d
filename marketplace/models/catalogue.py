"""The GPU catalogue: datasheet figures per model, loaded from marketplace/data/gpu_models.json."""
from django.db import models


class GpuModel(models.Model):
    slug = models.SlugField(max_length=40, unique=True, help_text="Stable id used in the API, e.g. a100-80gb-sxm.")
    name = models.CharField(max_length=60, help_text="Marketing name, e.g. A100 80GB SXM.")
    smi_name = models.CharField(max_length=80, unique=True, help_text="The `name` nvidia-smi reports.")
    architecture = models.CharField(max_length=30)
    form_factor = models.CharField(max_length=10, choices=[("pcie", "PCIe"), ("sxm", "SXM")])
    memory_gb = models.PositiveIntegerField(help_text="Nominal memory size in GB.")
    memory_mib = models.PositiveIntegerField(help_text="memory.total as nvidia-smi reports it (MiB).")
    # GDDR6 cards with ECC on give 1/16 of their memory to it; HBM keeps ECC beside the data (one size either way).
    memory_mib_ecc_off = models.PositiveIntegerField(help_text="memory.total with ECC off (MiB).")
    memory_mib_ecc_on = models.PositiveIntegerField(help_text="memory.total with ECC on (MiB).")
    memory_type = models.CharField(max_length=20, help_text="e.g. HBM2e, GDDR6 ECC.")
    memory_bandwidth_gbps = models.FloatField(help_text="Datasheet bandwidth, GB/s (10^9 bytes/s).")
    fp32_tflops = models.FloatField()
    tf32_tflops = models.FloatField(help_text="Dense TF32 tensor TFLOP/s.")
    bf16_tflops = models.FloatField(help_text="Dense BF16/FP16 tensor TFLOP/s.")
    figures_note = models.CharField(max_length=200, blank=True, help_text="Where a figure is derived or qualified.")
    tdp_w = models.PositiveIntegerField()
    pcie_gen = models.PositiveSmallIntegerField()
    pcie_lanes = models.PositiveSmallIntegerField(default=16)
    cuda_cores = models.PositiveIntegerField()
    tensor_cores = models.PositiveIntegerField()
    mig_max_instances = models.PositiveSmallIntegerField(default=0, help_text="0 when MIG is not supported.")

    class Meta:
        ordering = ["name"]
        verbose_name = "GPU model"

    def __str__(self):
        return self.name

    @property
    def mig_supported(self) -> bool:
        return self.mig_max_instances > 0
