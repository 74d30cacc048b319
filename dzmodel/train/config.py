"""Training configuration: one typed dataclass, checked before anything runs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..model.lora import LoRAConfig


@dataclass
class TrainConfig:
    # model
    preset: str = "tiny"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    init_dit: str | None = None            # WAN DiT file for a cold start (action/state modules stay at init)
    encoder_weights: dict[str, str] = field(default_factory=dict)  # {vae, t5, clip}: WAN files; empty = seeded random
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # rank > 0: adapters on the DiT, base frozen (docs/training.md)
    # data
    datasets: list[str] = field(default_factory=list)
    dataset_weights: list[float] | None = None
    embodiment: str = "libero_sim"
    embodiment_files: list[str] = field(default_factory=list)
    metadata: str | None = None             # metadata.json with the embodiment's statistics
    tokenizer: str | None = None            # local HF tokenizer dir (built offline for the tiny preset if missing)
    num_workers: int = 0
    frame_cache_mib: int = 0                # per loader process: keep decoded episodes in memory (0: decode per window)
    cache: str | None = None                # a `dz cache` directory: train from precomputed encoder outputs
    heldout_episodes: int = 0               # the last N episodes of each dataset are never trained on (eval only)
    skip_missing: bool = False              # train on the other episodes when some view videos are missing (listed)
    data_on_device: bool = False            # decode the whole recording once onto the training device; batches are
                                            # gathered and augmented there, no loader workers (docs/training.md)
    augment: bool = True                    # random crop + colour jitter per sample (False: the eval transforms)
    # data_on_device only. 0: the frozen encoders run on every micro-batch. K >= 1: before training, every window is
    # augmented K times and encoded once per copy, on the device; pass e over the data trains on copy e mod K. The
    # encoders then cost K passes instead of one per epoch (docs/training.md)
    encoded_variants: int = 0
    # optimisation (reference §5.1)
    steps: int = 100
    # when set, the run's length in passes over the training windows (one per anchor frame): steps becomes
    # ceil(epochs x windows / global_batch), so a bigger recording trains longer at the same recipe
    epochs: float | None = None
    stop_at: int | None = None              # end this invocation after this step (schedule still spans `steps`)
    micro_batch: int = 2
    global_batch: int = 2                   # = micro_batch x world_size x accumulation
    lr: float = 1e-5
    betas: tuple[float, float] = (0.95, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-5
    warmup_ratio: float = 0.05
    min_lr: float = 0.0
    schedule: str = "cosine"                # cosine | constant
    grad_clip: float = 1.0
    ema_decay: float = 0.0                  # > 0: keep an EMA of the trainable weights (e.g. 0.999); 0: off
    noise_on: str = "device"                # where each sample's timesteps and noise are drawn: device | cpu
    # a sample's prompt is replaced by the null prompt "" with this probability (decided per sample from the seed
    # and its stream position), so inference's unconditional CFG branch sees a context it was trained on
    prompt_dropout: float = 0.0
    # systems
    precision: str = "fp32"                 # compute dtype: fp32 | bf16 (master weights and Adam state stay fp32)
    reduce_dtype: str = "fp32"              # gradient reduce-scatter dtype: fp32 | bf16
    sharding: str = "full"                  # full | hybrid | none (FSDP2 when world_size > 1)
    activation_checkpointing: str = "none"  # none | elementwise | selective | full | full:N
    compile: bool = False
    attn_backend: str = "auto"
    # bookkeeping
    out_dir: str = "runs/train"
    save_every: int = 50                    # 0: never checkpoint (a measurement run; nothing to resume or convert)
    log_every: int = 1
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)  # type: ignore[assignment]
        if isinstance(self.lora, dict):  # built in code rather than from_dict
            from ..schema import build

            self.lora = build(LoRAConfig, self.lora, path="train.lora")
        choices = {"precision": ("fp32", "bf16"), "reduce_dtype": ("fp32", "bf16"), "sharding": ("full", "hybrid", "none"),
                   "schedule": ("cosine", "constant"), "noise_on": ("device", "cpu"),
                   "attn_backend": ("auto", "flex", "segments", "sdpa")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"train.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        from .parallelize import AC_MODES

        unknown = sorted(set(self.encoder_weights) - {"vae", "t5", "clip"})
        if unknown:
            raise ValueError(f"train.encoder_weights has unknown key(s) {unknown}; allowed: vae, t5, clip")

        ac = self.activation_checkpointing
        if ac not in AC_MODES and not (ac.startswith("full:") and ac[5:].isdigit()):
            raise ValueError(f"train.activation_checkpointing must be one of {AC_MODES} or full:N, got {ac!r}")
        for name in ("steps", "micro_batch", "global_batch", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.epochs is not None and self.epochs <= 0:
            raise ValueError(f"train.epochs must be > 0 (null: train.steps sets the length), got {self.epochs}")
        if self.save_every < 0:
            raise ValueError(f"train.save_every must be >= 0 (0: never checkpoint), got {self.save_every}")
        if self.heldout_episodes < 0:
            raise ValueError(f"train.heldout_episodes must be >= 0, got {self.heldout_episodes}")
        if self.data_on_device and self.cache:
            raise ValueError("train.data_on_device decodes the recording and encodes every micro-batch live (its "
                             "augmented frames are not in a `dz cache`): unset train.cache or data_on_device")
        if self.encoded_variants < 0:
            raise ValueError(f"train.encoded_variants must be >= 0 (0: encode every micro-batch), got {self.encoded_variants}")
        if self.encoded_variants and not self.data_on_device:
            raise ValueError("train.encoded_variants needs train.data_on_device: true (the copies are encoded from the "
                             "frames on the device)")
        if self.encoded_variants > 1 and not self.augment:
            raise ValueError(f"train.encoded_variants {self.encoded_variants} with train.augment false would encode "
                             "identical copies: use 1")
        if self.frame_cache_mib < 0:
            raise ValueError(f"train.frame_cache_mib must be >= 0 (0: off), got {self.frame_cache_mib}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"train.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"train.ema_decay must be in [0, 1) (0: no EMA), got {self.ema_decay}")
        if not 0 <= self.prompt_dropout <= 1:
            raise ValueError(f"train.prompt_dropout must be in [0, 1] (0: off), got {self.prompt_dropout}")
        if self.lr <= 0 or self.grad_clip <= 0:
            raise ValueError("train.lr and train.grad_clip must be > 0")

    def accumulation(self, world_size: int) -> int:
        per_step = self.micro_batch * world_size
        if self.global_batch % per_step:
            raise ValueError(f"train.global_batch {self.global_batch} is not a multiple of micro_batch x world_size "
                             f"= {self.micro_batch} x {world_size}")
        return self.global_batch // per_step

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "train") -> "TrainConfig":
        """Unknown keys, wrong types and bad values: one ValueError naming every field (`where`.key)."""
        from ..schema import build

        return build(cls, d, path=where)
