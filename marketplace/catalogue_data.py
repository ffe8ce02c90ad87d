"""Loads marketplace/data/gpu_models.json into the GpuModel table (used by migrations)."""
import json
from pathlib import Path

DATA_FILE = Path(__file__).resolve().parent / "data" / "gpu_models.json"


def load_gpu_models(gpu_model_class) -> int:
    """Insert or update every model of the data file by slug; returns how many rows it wrote."""
    models = json.loads(DATA_FILE.read_text())["models"]
    # A migration passes the model as it was then: fields the file gained later are left to the migration adding them.
    known = {f.name for f in gpu_model_class._meta.get_fields()}
    for row in models:
        fields = {k: v for k, v in row.items() if k != "slug" and k in known}
        gpu_model_class.objects.update_or_create(slug=row["slug"], defaults=fields)
    return len(models)
