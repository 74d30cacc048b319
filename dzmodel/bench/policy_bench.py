"""`dz bench policy`: latency of one action chunk through the serving code path (`DreamZeroPolicy.predict_batch`,
which `dz serve`, `dz eval libero` and `predict_actions` all use).

Random weights at the preset's real sizes (the DiT and its frozen encoders). Each call sends every session a fresh
single frame, as in the LIBERO protocol (reference §6.1: the KV cache restarts on every call), so a call runs the
image encoder, one VAE encode, the prefill and the flow solver (the prompt's umT5 embedding is cached unless
text_cache is off). Reports p50 / p95 / max milliseconds per call, chunks per second, and a breakdown per stage
(encoders, vae, prefill, solver, decode) from extra calls that synchronise at each stage edge.

`--ladder` measures the optimisations one at a time in one process (one model build): each row adds one step to
the row before it, from the old path (fp32 weights under autocast, two CFG passes, no text cache, eager) on.

Each row also says what the timed calls paid for besides the GPU's work (`TailWatch`: garbage collections, new
device memory, CUDA-graph captures) and lists every call's time in order, to find what makes the slow ones slow;
`--gc-freeze` freezes the heap after the warm-up, as `dz serve` does.

Each row also counts the model FLOPs of one call (`torch.utils.flop_counter`, in one extra call run eagerly without
CUDA graphs, whose kernels a counter cannot see): the matmuls, convolutions and attention of every stage, by op, and
from them the call's TFLOP/s at its p50 and its share of the device's dense bf16 peak (`mfu`, as the training rows
count it), which says how far a setting is from what the GPU can do.

`--precision fp8` measures the setting twice on one model: with bf16 weights, then with the DiT blocks' linears
rounded to e4m3 (`model.fp8.freeze_blocks_to_fp8`); the FP8 row also gives how far its chunks are from the bf16
ones for the same observations and noise (`chunk_diff_vs_bf16`). A device without FP8 gives the row's reason.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
from torch.utils import flop_counter

from ..data.transforms import NormStats
from ..model.args import preset
from ..model.components import build_encoders
from ..model.fp8 import fp8_linears, freeze_blocks_to_fp8, resolve_precision
from ..model.cuda_graphs import GraphCache
from ..model.sampler import SolverConfig
from ..model.tokenizer import build_tiny_tokenizer, load_tokenizer
from ..model.wam import DreamZeroWAM
from ..policy.sessions import STAGES, StageTimer, build_policy
from ..train.metrics import peak_flops

WEIGHTS = ("autocast", "bf16", "fp32", "fp8")  # autocast: fp32 weights under bf16 autocast (the old GPU path);
# fp8: bf16 weights, the DiT blocks' linears in e4m3 (irreversible on the model: FP8 settings run last)


@dataclass(frozen=True)
class PolicySetting:
    name: str = "custom"
    weights: str = "bf16"
    solver_steps: int = 16
    cfg_scale: float = 5.0
    batch_cfg: bool = True
    dit_steps: str = ""
    text_cache: bool = True
    cuda_graphs: bool = True
    compile: bool = False
    reuse_cross_kv: bool = True

    def __post_init__(self) -> None:
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {self.weights!r}")

    def solver(self) -> SolverConfig:
        return SolverConfig(num_steps=self.solver_steps, cfg_scale=self.cfg_scale, batch_cfg=self.batch_cfg,
                            dit_steps=self.dit_steps, reuse_cross_kv=self.reuse_cross_kv)


def ladder() -> list[PolicySetting]:
    """The optimisations one at a time (each row keeps the ones above), then the fewer-step settings."""
    rows = [PolicySetting("old settings: fp32 weights + autocast, two CFG passes, umT5 every call, eager",
                          weights="autocast", batch_cfg=False, text_cache=False, cuda_graphs=False, reuse_cross_kv=False)]
    for name, change in (("+ CFG as one batch-2 forward", dict(batch_cfg=True)),
                         ("+ bf16 weights", dict(weights="bf16")),
                         ("+ umT5 cached per prompt", dict(text_cache=True)),
                         ("+ CUDA graphs (prefill, solver)", dict(cuda_graphs=True)),
                         ("+ cross-attention K/V once per chunk", dict(reuse_cross_kv=True)),
                         ("+ torch.compile of the DiT block", dict(compile=True)),
                         ("+ DiT caching: 8 of 16 steps (upstream schedule)", dict(dit_steps="upstream"))):
        rows.append(replace(rows[-1], name=name, **change))
    deploy = rows[-1]
    rows += [replace(deploy, name="deploy, no CFG", cfg_scale=1.0),
             replace(deploy, name="fast: 4 steps, CFG 5", solver_steps=4, dit_steps=""),
             replace(deploy, name="fast: 4 steps, no CFG", solver_steps=4, dit_steps="", cfg_scale=1.0)]
    return rows


def random_policy(preset_name: str, device: str, weights: str, seed: int, overrides: dict | None = None,
                  action_dim: int | None = None, state_dim: int = 8, image_size: tuple[int, int] | None = None):
    """The preset's model and frozen encoders with random weights (`weights` "bf16": built in bf16, else fp32), a
    tiny tokenizer, and unit statistics of `action_dim` (default the model's) and `state_dim` widths."""
    torch.manual_seed(seed)
    args = preset(preset_name, **(overrides or {}))
    # bf16 from the start when no fp32 row needs the fp32 weights (14B + umT5-XXL in fp32 exceed one H100)
    dtype = torch.bfloat16 if weights == "bf16" else torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DreamZeroWAM(args)
            encoders = build_encoders(preset_name, device=device)
    finally:
        torch.set_default_dtype(default)
    with tempfile.TemporaryDirectory() as tok_dir:  # ids only feed the embedding; latency does not depend on them
        tokenizer = load_tokenizer(build_tiny_tokenizer(tok_dir))
    unit = lambda n: NormStats(q01=-np.ones(n), q99=np.ones(n))  # noqa: E731
    return build_policy(model, encoders, tokenizer, unit(action_dim or args.action_dim), unit(state_dim), seed=seed,
                        image_size=image_size)


def _configure(policy, setting: PolicySetting, device: str) -> None:
    if setting.weights in ("bf16", "fp8") and policy.model.patch_embedding.weight.dtype != torch.bfloat16:
        for m in (policy.model, policy.vae, policy.text_encoder, policy.image_encoder):
            m.to(torch.bfloat16)
    if setting.weights not in ("bf16", "fp8") and policy.model.patch_embedding.weight.dtype != torch.float32:
        raise ValueError(f"setting {setting.name!r} needs fp32 weights: run fp32/autocast settings before bf16 ones")
    policy.solver = setting.solver()
    policy.text_cache_size = 64 if setting.text_cache else 0
    policy._texts.clear()
    policy.graphs = GraphCache(enabled=setting.cuda_graphs and device.startswith("cuda"))
    policy.set_compile(setting.compile)
    policy.sessions.clear()


def _observations(policy, rng: np.random.Generator, batch: int, prefix: str) -> list[dict]:
    """One fresh single-frame observation per session `prefix-i`, as a LIBERO client sends them."""
    h, w = policy.image_size
    return [{"images": rng.integers(0, 255, (h, w, 3), dtype=np.uint8), "state": np.zeros(8),
             "prompt": "pick up the bowl and place it on the plate", "session_id": f"{prefix}-{i}"}
            for i in range(batch)]


def fixed_chunks(policy, batch: int, seed: int) -> np.ndarray:
    """Chunks [batch, T, D] for fixed observations in fresh sessions: the same numbers from any weights the same
    up to precision (each session's noise follows its seed and history)."""
    obs = _observations(policy, np.random.default_rng(seed + 1), batch, "compare")
    policy.sessions.clear()
    chunks = np.stack(policy.predict_batch(obs))
    policy.sessions.clear()
    return chunks


def chunk_difference(chunks: np.ndarray, reference: np.ndarray) -> dict:
    """How far `chunks` are from `reference`: the largest absolute difference, and the relative L2 norm."""
    diff = chunks - reference
    return {"max_abs": round(float(np.abs(diff).max()), 5),
            "rel_l2": round(float(np.linalg.norm(diff) / max(np.linalg.norm(reference), 1e-12)), 5)}


class TailWatch:
    """What happens during timed calls besides the GPU's work: Python's garbage collections (count, total and
    longest pause, per generation, from `gc.callbacks`), new device memory segments (cudaMalloc: the caching
    allocator had no free block) and allocator retries, and CUDA-graph captures. A call that pays for one of these
    is a tail call."""

    def __init__(self, policy, cuda: bool):
        self.policy, self.cuda = policy, cuda
        self.pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses[info["generation"]].append((time.perf_counter() - self._t0) * 1e3)

    def _memory(self) -> tuple[int, int]:
        if not self.cuda:
            return 0, 0
        stats = torch.cuda.memory_stats()
        return stats.get("segment.all.allocated", 0), stats.get("num_alloc_retries", 0)

    def __enter__(self):
        import gc

        self._memory0, self._captures0 = self._memory(), self.policy.graphs.captures
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        import gc

        gc.callbacks.remove(self._callback)
        segments, retries = self._memory()
        self.report = {
            "gc_pauses": {f"gen{g}": {"count": len(p), "total_ms": round(sum(p), 2), "max_ms": round(max(p, default=0.0), 2)}
                          for g, p in self.pauses.items()},
            "new_memory_segments": segments - self._memory0[0], "alloc_retries": retries - self._memory0[1],
            "graph_captures_timed": self.policy.graphs.captures - self._captures0}


def _sdpa_for_cpu_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


# attention on a CPU runs this op, which torch's counter leaves out (it counts the CUDA ones; its registered
# formula cannot be passed again: the counter would wrap it a second time)
_EXTRA_FLOP_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_for_cpu_flops}


def count_call_flops(policy, call) -> tuple[int, dict[str, int]]:
    """Model FLOPs of `call()` (one policy call), eager and without CUDA graphs (a graph replay or a compiled
    block hides its ops from the counter): the total and the FLOPs per op. The policy's compiled block runner and
    graph cache are put back afterwards, so the timed calls before and after it are unchanged."""
    runner, graphs = policy.model.block_runner, policy.graphs
    policy.model.block_runner, policy.graphs = None, GraphCache(enabled=False)
    try:
        counter = flop_counter.FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOP_FORMULAS)
        with counter:
            call()
    finally:
        policy.model.block_runner, policy.graphs = runner, graphs
    by_op = {str(op): int(n) for op, n in counter.get_flop_counts().get("Global", {}).items()}
    return counter.get_total_flops(), by_op


def _measure(policy, setting: PolicySetting, device: str, batch: int, calls: int, warmup: int,
             breakdown_calls: int, seed: int, gc_freeze: bool = False) -> dict:
    import gc

    rng = np.random.default_rng(seed)
    cuda = device.startswith("cuda")

    def predict(obs: list[dict]) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda and setting.weights == "autocast"):
            policy.predict_batch(obs)

    def one_call() -> float:
        obs = _observations(policy, rng, batch, "bench")
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        predict(obs)
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        one_call()
    if gc_freeze:  # what dz serve does after its warm-up: the model's objects leave the collector's scans
        gc.collect()
        gc.freeze()
    with TailWatch(policy, cuda) as watch:
        in_order = [one_call() for _ in range(calls)]
    if gc_freeze:
        gc.unfreeze()
    times = sorted(in_order)
    policy.timer = StageTimer(policy.device)
    for _ in range(breakdown_calls):
        one_call()
    parts = {s: round(statistics.median(c[s] for c in policy.timer.calls), 1) for s in STAGES} if breakdown_calls else {}
    policy.timer = None
    p50 = statistics.median(times)
    peak_mem = round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None  # before the eager count call
    peak = peak_flops(torch.device(device))
    try:  # eager: no padding of the batch to the graphs' sizes, so it counts the work the batch asked for
        flops, flops_by_op = count_call_flops(policy, lambda: predict(_observations(policy, rng, batch, "bench")))
        flops_per_s = flops / (p50 / 1e3)
        counted = {"model_gflops_per_call": round(flops / 1e9, 3),
                   "model_gflops_by_op": {op: round(n / 1e9, 3) for op, n in sorted(flops_by_op.items(),
                                                                                   key=lambda kv: -kv[1])},
                   "model_tflops_per_s": float(f"{flops_per_s / 1e12:.4g}"),  # 4 digits: a CPU call makes ~1e-4
                   "mfu": round(flops_per_s / peak, 4) if peak else None}
    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:  # the timings stand without the count
        counted = {"model_gflops_per_call": None, "flops_error": f"{type(exc).__name__}: {exc}"[:300]}
        if cuda:
            torch.cuda.empty_cache()
    solver = setting.solver()
    return {**asdict(setting), "dit_forwards": solver.dit_forwards, "batch": batch,
            # p95 interpolated between ranks (numpy's default); with fewer than 20 calls it lies near the slowest
            "calls": calls, "p50_ms": round(p50, 1), "p95_ms": round(float(np.percentile(times, 95)), 1),
            "max_ms": round(times[-1], 1), "chunks_per_s": round(batch * 1e3 / p50, 2), "breakdown_ms": parts,
            **counted,
            "per_call_ms": [round(t, 2) for t in in_order], "gc_freeze": gc_freeze, **watch.report,
            "graph_captures": policy.graphs.captures, "peak_mem_gib": peak_mem}


def run_policy_bench(preset_name: str = "tiny", device: str = "cpu", settings: list[PolicySetting] | None = None,
                     batches: tuple[int, ...] = (1,), calls: int = 10, warmup: int = 2, breakdown_calls: int = 3,
                     seed: int = 0, progress=None, gc_freeze: bool = False) -> list[dict]:
    """One JSON-able row per (setting, batch). Settings run in order on one model: fp32/autocast before bf16."""
    settings = settings or [PolicySetting()]
    fp8_rows = [i for i, s in enumerate(settings) if s.weights == "fp8"]
    if fp8_rows and any(s.weights != "fp8" for s in settings[fp8_rows[0]:]):
        raise ValueError("FP8 settings round the model's weights for good: put them after every other setting")
    build_dtype = "bf16" if all(s.weights in ("bf16", "fp8") for s in settings) else "fp32"
    policy = random_policy(preset_name, device, build_dtype, seed)
    h, w = policy.image_size
    common = {"preset": preset_name, "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
              "image_size": [h, w], "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    rows = []
    references: dict[int, np.ndarray] = {}  # per FP8 setting: its bf16 chunks, with its own solver
    for index, setting in enumerate(settings):
        extra: dict = {}
        if setting.weights == "fp8" and not fp8_linears(policy.model):  # the first FP8 setting: round the model
            _, why = resolve_precision("fp8", device)
            if why is not None:  # this device cannot: the rows say so, nothing is measured in their name
                for later in settings[index:]:
                    for batch in batches:
                        row = {**common, **asdict(later), "batch": batch, "error": why}
                        rows.append(row)
                        if progress is not None:
                            progress(row)
                break
            for i in fp8_rows:
                _configure(policy, replace(settings[i], weights="bf16", compile=False), device)
                references[i] = fixed_chunks(policy, max(batches), seed)
            freeze_blocks_to_fp8(policy.model)
        _configure(policy, setting, device)
        if setting.weights == "fp8":
            extra = {"chunk_diff_vs_bf16": chunk_difference(fixed_chunks(policy, max(batches), seed),
                                                            references[index])}
        for batch in batches:
            try:
                row = {**common, **_measure(policy, setting, device, batch, calls, warmup, breakdown_calls, seed,
                                            gc_freeze),
                       **extra}
            except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:  # a row that cannot run says why; the rest go on
                row = {**common, **asdict(setting), "batch": batch, "error": f"{type(exc).__name__}: {exc}"[:500]}
                policy.sessions.clear()
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows
