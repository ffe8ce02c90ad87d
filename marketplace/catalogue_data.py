"""Loads marketplace/data/gpu_models.json into the GpuModel table (used by migrations)."""
import json
from pathlib import Path

DATA_FILE = Path(__file__).resolve().parent / "data" / "gpu_models.json"


def load_gpu_models(gpu_model_class) -> int:
    """Insert or update every model of the data file by slug; returns how many rows it wrote."""
    models = json.loads(DATA_FILE.read_text())["models"]
    for row in models:
        fields = {k: v for k, v in row.items() if k != "slug"}
        gpu_model_class.objects.update_or_create(slug=row["slug"], defaults=fields)
    return len(models)
