"""Training configuration: one typed dataclass, checked before anything runs. Each numeric field's range sits in its
metadata (dzmodel/schema.py): `from_dict` and params.yaml refuse a value outside it by name, and so does a config
built in code."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ..model.lora import LoRAConfig

SEED = {"min": 0, "max": 2**32 - 1}  # numpy's legacy seeding takes 32 bits
UNIT = {"min": 0, "max": 1}          # a probability or a fraction


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
    dataset_weights: list[float] | None = field(default=None, metadata={"gt": 0, "max": 1e6})  # relative
    embodiment: str = "libero_sim"
    embodiment_files: list[str] = field(default_factory=list)
    # one embodiment tag per dataset, for a mixture of robots (default: `embodiment` for all); `embodiment` stays
    # the one the converted model is packaged and served for. Each dataset is normalised with its own tag's
    # statistics in `metadata` (`dz data metadata --merge` adds a tag to a file)
    dataset_embodiments: list[str] = field(default_factory=list)
    metadata: str | None = None             # metadata.json with the embodiment's statistics
    tokenizer: str | None = None            # local HF tokenizer dir (built offline for the tiny preset if missing)
    num_workers: int = field(default=0, metadata={"min": 0, "max": 256})
    # per loader process: keep decoded episodes in memory (0: decode per window)
    frame_cache_mib: int = field(default=0, metadata={"min": 0, "max": 1 << 20})
    cache: str | None = None                # a `dz cache` directory: train from precomputed encoder outputs
    # the last N episodes of each dataset are never trained on (eval only)
    heldout_episodes: int = field(default=0, metadata={"min": 0})
    # held-out samples as a `dz cache` directory (of the same preset): their mean losses at fixed draws are logged as
    # val_loss, val_dynamics_loss and val_action_loss every val_every steps (0: at each checkpoint and the last step)
    val_cache: str | None = None
    val_every: int = field(default=0, metadata={"min": 0})
    skip_missing: bool = False              # train on the other episodes when some view videos are missing (listed)
    data_on_device: bool = False            # decode the whole recording once onto the training device; batches are
                                            # gathered and augmented there, no loader workers (docs/training.md)
    augment: bool = True                    # random crop + colour jitter per sample (False: the eval transforms)
    # where the CPU loader's videos are decoded: cpu (its workers) or nvdec (the training GPU's video engine, through
    # PyNvVideoCodec; the workers read only the vectors, and the frames are cropped, resized and jittered on the GPU:
    # dzmodel/data/nvdec.py)
    video_decode: str = "cpu"
    # video_decode nvdec: threads that decode a micro-batch's files side by side (a GPU has several NVDEC engines).
    # 8: at the 5B DROID shape on an H200, 21.7-28.7 samples/s in five runs against 17.9-18.4 with 4 (performance.md)
    nvdec_threads: int = field(default=8, metadata={"min": 1, "max": 256})
    # data_on_device only. 0: the frozen encoders run on every micro-batch. K >= 1: before training, every window is
    # augmented K times and encoded once per copy, on the device; pass e over the data trains on copy e mod K. The
    # encoders then cost K passes instead of one per epoch (docs/training.md)
    encoded_variants: int = field(default=0, metadata={"min": 0, "max": 64})
    # Sequence packing: each micro-batch's samples, which may differ in cameras, frame size, chunk count and action
    # and state dims (a mixture of embodiments), run as token sequences packed into buffers where each attends only
    # its own tokens and context; each sample's loss is the one it gets alone. pack_capacity: tokens per buffer
    # (0: one buffer holds the micro-batch)
    packing: bool = False
    pack_capacity: int = field(default=0, metadata={"min": 0, "max": 1 << 24})
    # optimisation (reference §5.1)
    steps: int = field(default=100, metadata={"min": 1})
    # when set, the run's length in passes over the training windows (one per anchor frame): steps becomes
    # ceil(epochs x windows / global_batch), so a bigger recording trains longer at the same recipe
    epochs: float | None = field(default=None, metadata={"gt": 0, "max": 1e6})
    # end this invocation after this step (schedule still spans `steps`)
    stop_at: int | None = field(default=None, metadata={"min": 1})
    micro_batch: int = field(default=2, metadata={"min": 1, "max": 1 << 16})
    global_batch: int = field(default=2, metadata={"min": 1, "max": 1 << 20})  # = micro_batch x world_size x accumulation
    lr: float = field(default=1e-5, metadata={"gt": 0, "max": 1.0})
    betas: tuple[float, float] = field(default=(0.95, 0.999), metadata={"min": 0, "lt": 1})
    eps: float = field(default=1e-8, metadata={"gt": 0, "max": 1.0})
    weight_decay: float = field(default=1e-5, metadata=UNIT)
    warmup_ratio: float = field(default=0.05, metadata={"min": 0, "lt": 1})
    min_lr: float = field(default=0.0, metadata={"min": 0})  # at most lr
    schedule: str = "cosine"                # cosine | constant
    grad_clip: float = field(default=1.0, metadata={"gt": 0})
    # > 0: keep an EMA of the trainable weights (e.g. 0.999); 0: off
    ema_decay: float = field(default=0.0, metadata={"min": 0, "lt": 1})
    noise_on: str = "device"                # where each sample's timesteps and noise are drawn: device | cpu
    # a sample's prompt is replaced by the null prompt "" with this probability (decided per sample from the seed
    # and its stream position), so inference's unconditional CFG branch sees a context it was trained on
    prompt_dropout: float = field(default=0.0, metadata=UNIT)
    # the noisy copy of frame 0 in the training sequence, as upstream: a loss term of its own (denoise the first
    # frame from the prompt and its CLIP image) that inference never runs, as it starts from the clean frame. false
    # leaves it out: 12 % fewer tokens at libero_object's shape; nothing else in the sequence changes
    denoise_first_frame: bool = True
    # systems
    precision: str = "fp32"                 # compute dtype: fp32 | bf16 | fp8 (the blocks' linears in FP8, the rest
                                            # bf16; bf16 where the device has no FP8); master weights and Adam stay fp32
    # under precision fp8, the blocks' linears that stay bf16, by their dotted names in a block or a leading part
    # ("self_attn.o", "cross_attn" for its projections); empty: every linear of the blocks runs FP8
    fp8_bf16_layers: list[str] = field(default_factory=list)
    # under precision fp8 and activation_checkpointing elementwise, keep each FP8 linear's e4m3 input for the
    # backward rather than recompute it from the bf16 input: 1 byte more per element of those inputs, for two
    # passes over them fewer (docs/performance.md); wide: only the inputs at least 8192 wide (the FFN's down
    # projection's), less than half the memory of true (docs/training.md)
    fp8_keep_inputs: bool | Literal["wide"] = False
    # the tokens between blocks in the compute dtype (bf16), as inference with bf16 weights and FSDP2 training run
    # them; off, one process under autocast keeps them in fp32 (the action and state tokens' fp32 biases make the
    # stream fp32). At the libero_object shape on one H100: 4.5 % faster, two rows each on one host (a single row on
    # another: 0.5 %)
    residual_in_compute_dtype: bool = False
    reduce_dtype: str = "fp32"              # gradient reduce-scatter dtype: fp32 | bf16
    sharding: str = "full"                  # full | hybrid | none (FSDP2 when world_size > 1)
    activation_checkpointing: str = "none"  # none | elementwise | selective | full | full:N
    compile: bool = False
    # Inductor settings for the compiled blocks (names in torch._inductor.config), e.g. {combo_kernels: true}: one
    # kernel for several independent ones. They change how the blocks are compiled, not what they compute; the
    # trainer's compile check still compares the result with eager before training
    compile_options: dict[str, Any] = field(default_factory=dict)
    # what `compile` compiles: each block on its own (blocks), or the model's whole forward and the loss as one graph
    # (step: one process; activation_checkpointing none or elementwise; no packing). At the libero_object shape on
    # one H100, step ran 1,943 samples/s against 1,745 for blocks, with CUDA graphs, two rows each on one machine
    # (docs/performance.md)
    compile_scope: str = "blocks"
    # the compiled blocks as CUDA graphs (torch.compile's reduce-overhead mode): one replay per block and pass
    # instead of ~130 kernel launches from Python, for steps whose host side is slower than the GPU's work
    # (docs/performance.md); one process on CUDA only (FSDP2 gathers the weights anew every step)
    cuda_graphs: bool = False
    attn_backend: str = "auto"
    # bookkeeping
    out_dir: str = "runs/train"
    # 0: never checkpoint (a measurement run; nothing to resume or convert)
    save_every: int = field(default=50, metadata={"min": 0})
    log_every: int = field(default=1, metadata={"min": 1})
    seed: int = field(default=0, metadata=SEED)
    progress: bool = True

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)  # type: ignore[assignment]
        from ..schema import build, field_problems

        if isinstance(self.lora, dict):  # built in code rather than from_dict
            self.lora = build(LoRAConfig, self.lora, path="train.lora")
        problems = field_problems(self, "train")  # the metadata ranges, for configs built in code
        if problems:
            raise ValueError(problems[0])
        from .parallelize import AC_MODES, COMPILE_SCOPES

        choices = {"precision": ("fp32", "bf16", "fp8"), "reduce_dtype": ("fp32", "bf16"), "sharding": ("full", "hybrid", "none"),
                   "schedule": ("cosine", "constant"), "noise_on": ("device", "cpu"),
                   "attn_backend": ("auto", "flex", "segments", "sdpa"), "compile_scope": COMPILE_SCOPES,
                   "video_decode": ("cpu", "nvdec")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"train.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.fp8_bf16_layers and self.precision != "fp8":
            raise ValueError(f"train.fp8_bf16_layers names linears kept in bf16 under precision fp8; precision is "
                             f"{self.precision!r}: leave it out, or set precision: fp8")
        if self.precision == "fp8" and self.lora.enabled:
            raise ValueError("train.precision fp8 converts the blocks' plain linears, and LoRA adapts those same "
                             "layers: train LoRA with precision bf16, or fp8 without train.lora")
        unknown = sorted(set(self.encoder_weights) - {"vae", "t5", "clip"})
        if unknown:
            raise ValueError(f"train.encoder_weights has unknown key(s) {unknown}; allowed: vae, t5, clip")

        ac = self.activation_checkpointing
        if ac not in AC_MODES and not (ac.startswith("full:") and ac[5:].isdigit()):
            raise ValueError(f"train.activation_checkpointing must be one of {AC_MODES} or full:N, got {ac!r}")
        if not (isinstance(self.fp8_keep_inputs, bool) or self.fp8_keep_inputs == "wide"):
            raise ValueError(f"train.fp8_keep_inputs must be true, false or wide, got {self.fp8_keep_inputs!r}")
        if self.fp8_keep_inputs and (self.precision != "fp8" or not (ac == "elementwise" or ac.startswith("full:"))):
            raise ValueError(f"train.fp8_keep_inputs keeps the FP8 linears' inputs through elementwise recompute: it "
                             f"needs precision: fp8 and activation_checkpointing: elementwise (or full:N); got "
                             f"precision {self.precision!r} and activation_checkpointing {ac!r}")
        self._check_compile_options()
        if self.cuda_graphs and not self.compile:
            raise ValueError("train.cuda_graphs captures the compiled blocks: it needs train.compile: true")
        if self.cuda_graphs and ac not in ("none", "elementwise"):
            raise ValueError(f"train.cuda_graphs with train.activation_checkpointing {ac!r}: a whole-block "
                             "checkpoint reruns the captured forward inside the backward; use none or elementwise")
        if self.compile_scope == "step" and (ac not in ("none", "elementwise") or self.packing):
            raise ValueError("train.compile_scope: step compiles one-shape micro-batches with activation_checkpointing "
                             f"none or elementwise (got {ac!r}{', and packing' if self.packing else ''}): use "
                             "compile_scope: blocks")
        if self.min_lr > self.lr:
            raise ValueError(f"train.min_lr: must be <= train.lr ({self.lr}), got {self.min_lr}")
        if self.lora.rank > 0 and not self.lora.alpha > 0:
            raise ValueError(f"train.lora.alpha: must be > 0 with LoRA on (rank {self.lora.rank}), got {self.lora.alpha}")
        self._check_model()
        if self.data_on_device and self.cache:
            raise ValueError("train.data_on_device decodes the recording and encodes every micro-batch live (its "
                             "augmented frames are not in a `dz cache`): unset train.cache or data_on_device")
        if self.dataset_embodiments and len(self.dataset_embodiments) != len(self.datasets):
            raise ValueError(f"train.dataset_embodiments: one tag per dataset, got {len(self.dataset_embodiments)} for "
                             f"{len(self.datasets)} datasets")
        if self.packing and (self.data_on_device or self.cache):
            raise ValueError("train.packing runs the loader's samples one by one through the encoders: it needs "
                             "train.data_on_device: false and no train.cache")
        if self.packing and self.compile:
            raise ValueError("train.packing runs its buffers' blocks eagerly (each micro-batch packs to other shapes, "
                             "which compiled blocks would recompile for): set train.compile: false")
        if self.pack_capacity and not self.packing:
            raise ValueError("train.pack_capacity sizes packed buffers: set train.packing: true")
        if self.video_decode == "nvdec" and (self.data_on_device or self.cache or self.packing):
            what = "data_on_device" if self.data_on_device else "cache" if self.cache else "packing"
            raise ValueError(f"train.video_decode: nvdec decodes the CPU loader's videos on the GPU; train.{what} "
                             "does not use that loader (or, for packing, its collated batches): set video_decode: cpu")
        if self.encoded_variants and not self.data_on_device:
            raise ValueError("train.encoded_variants needs train.data_on_device: true (the copies are encoded from the "
                             "frames on the device)")
        if self.encoded_variants > 1 and not self.augment:
            raise ValueError(f"train.encoded_variants {self.encoded_variants} with train.augment false would encode "
                             "identical copies: use 1")

    def _check_compile_options(self) -> None:
        if not self.compile_options:
            return
        if not self.compile:
            raise ValueError("train.compile_options set how the blocks compile: they need train.compile: true")
        import torch._inductor.config as inductor

        known = inductor.get_config_copy()
        for key, value in self.compile_options.items():
            if key not in known or key.startswith("_"):
                raise ValueError(f"train.compile_options.{key}: not an Inductor setting (torch._inductor.config)")
            if key == "triton.cudagraphs":
                raise ValueError("train.compile_options.triton.cudagraphs: set train.cuda_graphs instead")
            default = known[key]
            if not isinstance(default, (bool, int, float, str)) or type(value) is not type(default):
                raise ValueError(f"train.compile_options.{key}: expected a {type(default).__name__} (its default is "
                                 f"{default!r}), got {value!r}")

    def _check_model(self) -> None:
        """A known preset, and overrides that build its args: each dimension an integer in its range, and the model
        within what a device holds (`dzmodel.model.args.max_model_bytes`)."""
        from ..model.args import PRESETS, preset
        from ..schema import SchemaError

        if self.preset not in PRESETS:
            raise ValueError(f"train.preset: must be one of {', '.join(repr(p) for p in PRESETS)}, got {self.preset!r}")
        for key, value in self.model_overrides.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not value > 0:
                raise ValueError(f"train.model_overrides.{key}: must be > 0, got {value}")
        try:
            preset(self.preset, **self.model_overrides)
        except SchemaError as exc:  # "dim: must be ..." -> "train.model_overrides.dim: must be ..."
            named = [f"train.model_overrides.{p}" if p.split(":", 1)[0] in self.model_overrides else
                     f"train.model_overrides: {p}" for p in exc.problems]
            raise ValueError("; ".join(named)) from None
        except (ValueError, TypeError, ArithmeticError) as exc:
            raise ValueError(f"train.model_overrides: {exc}") from None

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


# --- the files a run reads -----------------------------------------------------------------------
# A train config names them as given: a relative path is relative to the directory the run trained in, which the
# checkpoint records (trainer_state.json's `workdir`), so `dz convert` finds them from anywhere.

def locate(path: str, bases) -> str:
    """`path` as it is if it is a URI or absolute; else the first of base/path (for each base in order) that
    exists; else as given."""
    from pathlib import Path

    if "://" in path or Path(path).is_absolute():
        return path
    return next((str(Path(base) / path) for base in bases if (Path(base) / path).exists()), path)


def located(cfg: TrainConfig, bases) -> TrainConfig:
    """A copy of `cfg` with each relative input path looked up under `bases`, in order (`locate`)."""
    from dataclasses import replace

    bases = list(bases)

    def find(path):
        return locate(path, bases) if path else path

    return replace(cfg, datasets=[find(p) for p in cfg.datasets],
                   embodiment_files=[find(p) for p in cfg.embodiment_files],
                   metadata=find(cfg.metadata), tokenizer=find(cfg.tokenizer), init_dit=find(cfg.init_dit),
                   cache=find(cfg.cache), val_cache=find(cfg.val_cache),
                   encoder_weights={k: find(v) for k, v in cfg.encoder_weights.items()})
