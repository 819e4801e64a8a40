"""`ModelSpec`: what the toolkit knows about a model directory without loading any weights.

Its own module so that the checkpoint reader (which needs a spec) and the loader (which builds
specs and reads checkpoints) both depend on it, and not on each other both ways.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from toolkit.models.families import Family, ModelGeometry


@dataclasses.dataclass
class ModelSpec:
    """What the toolkit knows about a model directory without loading any weights."""
    path: Path
    config: Any  # transformers PretrainedConfig
    config_dict: dict
    config_hash: str
    family: Family
    geometry: ModelGeometry
    weight_files: tuple[Path, ...]

    @property
    def model_id(self) -> str:
        return self.config_dict.get("_name_or_path") or self.path.name
