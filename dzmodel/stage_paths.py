"""Where each pipeline stage writes, for one profile: fixed places under the project root (`dz stage`, dvc.yaml), or
one folder per stage cache key (the Prefect flow). Plain paths, no I/O."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .stage_table import STAGE_OF_OUTPUT, output_names

UNKEYED = "UNKEYED"  # a keyed run's folder of a stage that has no key yet (nothing may be written there)


@dataclass(frozen=True)
class StagePaths:
    """Where each stage writes, for one profile, relative to the project root.

    Unkeyed (`dz stage`, dvc.yaml): every stage writes at fixed places under runs/<profile>/ (data/<profile>/ for
    fetch), the paths dvc.yaml names, except the small files that compare runs, which go to metrics/<profile>/:
    the metrics JSONs and the plots (git carries the JSONs and the plots' CSVs, so that `dvc exp show`,
    `dvc metrics diff` and `dvc plots diff` compare commits and experiments). Keyed (the Prefect flow): each
    stage writes under its own folder for its cache key, runs/<profile>/store/<stage>/<key>/
    (data/<profile>/store/fetch/<key>/), with the same layout inside (metrics/ and plots/ included), so two runs
    with different inputs never write over each other's outputs and a cached result always points at the outputs
    it describes. A keyed run's `shared` stages write at the unkeyed places instead: the stages whose inputs are
    the ones dvc.yaml gives them, whose outputs DVC's cache keeps (the flow commits them to dvc.lock)."""
    root: Path
    profile: str
    keyed: bool = False
    keys: tuple[tuple[str, str], ...] = ()
    shared: tuple[str, ...] = ()

    def with_key(self, stage: str, key: str) -> "StagePaths":
        """These paths with `stage`'s outputs addressed by its cache key."""
        import dataclasses

        keys = tuple((s, k) for s, k in self.keys if s != stage) + ((stage, key),)
        return dataclasses.replace(self, keyed=True, keys=keys)

    def share(self, stage: str) -> "StagePaths":
        """These paths with `stage`'s outputs at the unkeyed places (DVC's workspace), its key kept for the record."""
        import dataclasses

        return dataclasses.replace(self, shared=tuple(s for s in self.shared if s != stage) + (stage,))

    def key(self, stage: str) -> str | None:
        return dict(self.keys).get(stage)

    def _unkeyed(self, stage: str) -> bool:
        return not self.keyed or stage in self.shared

    @property
    def run(self) -> Path:
        """The profile's folder under runs/."""
        return self.root / "runs" / self.profile

    @property
    def profile_data(self) -> Path:
        return self.root / "data" / self.profile

    def store(self, stage: str) -> Path:
        """Where a keyed run keeps a stage's outputs, one folder per cache key."""
        return (self.profile_data if stage == "fetch" else self.run) / "store" / stage

    def home(self, stage: str) -> Path:
        """The folder a stage writes under: the profile's, or, keyed, the one for the stage's cache key."""
        if self._unkeyed(stage):
            return self.profile_data if stage == "fetch" else self.run
        return self.store(stage) / (self.key(stage) or UNKEYED)

    @property
    def data(self) -> Path:
        return self.home("fetch")

    @property
    def dataset(self) -> Path:
        return self.data / "dataset"

    def stage(self, name: str) -> Path:
        return self.home(STAGE_OF_OUTPUT.get(name, name)) / name

    def outputs(self, stage: str) -> list[Path]:
        """What a stage writes, as its row of the stage table names it (the outs dvc.yaml declares for it, besides
        its metrics and plots)."""
        return [self.home(stage) / out for out in output_names(stage)]

    @property
    def metadata(self) -> Path:
        return self.home("metadata") / "metadata" / "metadata.json"

    @property
    def train_config(self) -> Path:
        return self.home("train") / "train_config.json"

    @property
    def tokenizer(self) -> Path:
        """The offline presets' tokenizer, which the cache stage builds."""
        return self.home("cache") / "tokenizer"

    @property
    def results(self) -> Path:
        """Unkeyed: the profile's folder of metrics and plots, metrics/<profile>/ (committed to git)."""
        return self.root / "metrics" / self.profile

    def metrics(self, stage: str) -> Path:
        if self._unkeyed(stage):
            return self.results / f"{stage}.json"
        return self.home(stage) / "metrics" / f"{stage}.json"

    def plots(self, stage: str) -> Path:
        if self._unkeyed(stage):
            return self.results / "plots"
        return self.home(stage) / "plots"

    def record(self, stage: str) -> Path:
        """The stage's result as its last run recorded it, with its outputs' fingerprint."""
        return self.home(stage) / "stages" / f"{stage}.json"

    @property
    def vision_vae(self) -> Path:
        """The vision stage's VAE, which train.encoder_weights.vae names when vision.enabled."""
        return self.stage("vision") / "vae.safetensors"
