"""The one interface every export target implements (`--target executorch|qnn|qai-hub`).

A target turns the step graphs (export.graphs.StepModel) into the files a phone runs, and later
checks and runs those files from a bundle directory. Its subclasses live in export/*_target.py; the
registry of instances is `export.manifest.TARGETS`. This module imports no target and nothing of the
bundle, so targets depend on it, and the bundle and manifest code depend on targets, one way only.
"""
from __future__ import annotations

import abc
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping

from toolkit.errors import SpecPrefetchError

if TYPE_CHECKING:  # annotations only
    from toolkit.runtime.backend import Backend


@dataclasses.dataclass
class Built:
    """What a target's build() returns: manifest entries, the reference and a bundle backend."""
    graphs: dict[str, Any]
    reference: Any
    reference_label: str
    backend_label: str
    kv_mode: str
    soc: str | None
    expert_precision: str
    make_backend: Callable[[], Any]
    extra: Callable[[list, list, dict], dict] | None = None  # (refs, bundle records, run_kw) -> figures

    def backend(self):
        return self.make_backend()

    def extra_parity(self, refs, gots, run_kw):
        return self.extra(refs, gots, run_kw) if self.extra else {}



class Target(abc.ABC):
    """An export target.

    Class attributes:
        NAME: the `--target` value.
        QUANTS: the `--quant` values it offers; DEFAULT_QUANT when `--quant` is not given.
        NEEDS_CALIBRATION: quant -> True where it needs QDQ calibration prompts.
        VISION_PRECISION: the precision its bundles' vision tower runs at whatever `--quant` (None: its
            bundles take no images).
    """
    NAME: ClassVar[str]
    QUANTS: ClassVar[tuple[str, ...]]
    DEFAULT_QUANT: ClassVar[str]
    NEEDS_CALIBRATION: ClassVar[Mapping[str, bool]] = {}
    VISION_PRECISION: ClassVar[str | None] = None

    @abc.abstractmethod
    def preflight(self, cfg: Any, quant: str) -> Any:
        """Fail fast, before any heavy work, on whatever this target needs and lacks (packages,
        SDK, SoC name, token, network), with an error naming what to install or pass."""

    @abc.abstractmethod
    def build(self, steps: Any, cfg: Any, quant: str, out_dir: Path, *, calib: list[list[int]],
              run_kw: dict[str, Any], log: Callable[[str], None], scratch: Path) -> "Built":
        """Write the step graphs for this target into `out_dir` (the bundle's graphs/) and return
        what parity needs: the reference backend, a way to open the built graphs, the manifest's
        `graphs` entry. `calib` are QDQ calibration prompts (empty unless NEEDS_CALIBRATION[quant]);
        `scratch` is a directory removed after the export."""

    @abc.abstractmethod
    def check_graphs(self, path: Path, m: dict[str, Any]) -> dict[str, Any]:
        """Check a bundle's graphs against its manifest (`m`): files, signatures, SoC; load them.
        Returns a per-graph summary. Any problem is a SpecPrefetchError naming the file."""

    @abc.abstractmethod
    def open_backend(self, path: Path, m: dict[str, Any]) -> "Backend":
        """A backend running the bundle's graphs (the bundle at `path`, its manifest `m`)."""

    def __repr__(self) -> str:
        return f"<target {self.NAME}>"


def bundle_file(path: Path, files: dict[str, Any], rel: Any, what: str) -> Path:
    """A path the manifest names: relative, inside the bundle, and one of its hashed files.

    (Defined here, below the targets, because their `check_graphs` resolve the manifest's paths
    with it; export.manifest re-exports it.)"""
    if not isinstance(rel, str) or not rel or Path(rel).is_absolute() or ".." in Path(rel).parts:
        raise SpecPrefetchError(f"{path / 'manifest.json'}: {what} {rel!r} is not a path inside the bundle")
    if rel not in files:
        raise SpecPrefetchError(f"{path / 'manifest.json'}: {what} {rel!r} is not among the hashed files")
    return path / rel
