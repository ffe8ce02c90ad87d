"""offers.profile_memory_gb (min_gpu_memory_gb under mig_profile, review r54 finding 2) is the catalogue's memory of
every profile of every model."""
import json
from pathlib import Path

from marketplace.api.offers import profile_memory_gb
from marketplace.mig import PROFILES_FILE, profiles_for


def test_each_profiles_memory_is_the_catalogues():
    models = json.loads(Path(PROFILES_FILE).read_text())["models"]
    for slug in models:
        for name, profile in profiles_for(slug).items():
            assert profile_memory_gb(name) == profile.memory_gb, (slug, name)
