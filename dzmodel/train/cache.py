"""`dz cache`: run the frozen encoders once per sample window, store the results, train from them.

RLinf recomputes umT5, CLIP and two VAE encodes every step (60 % extra FLOPs on 5B). The cache stores,
per sample window: the VAE latents (+ the 14B first-frame condition), the CLIP tokens of frame 0, the
normalised state/action rows, and an index into a table of text embeddings (one per unique prompt; a
dataset has few). Windows use the deterministic eval transforms (centre crop, no colour jitter).

Trade-off: per-step augmentation (random crop, colour jitter) and re-drawing windows around every anchor
are lost; a cache holds every `stride`-th anchor. Diffusion noise and timesteps are still drawn per step.

Layout (a DVC stage can track the directory):
    index.json                 config, datasets, embodiment, stride, shards and their sizes
    text.safetensors           embeddings [P, text_len, text_dim] of the P unique prompts, and null_context
                               [1, text_len, text_dim]: the null prompt's (train.prompt_dropout substitutes it)
    shard_00000.safetensors    clean_latents [n, z, F, h, w], clip_feature [n, T, D], state, action,
                               action_mask, prompt_index [n] (and y for first-frame models)
Built in a temporary sibling of the cache directory and renamed into place (`outputs.publish_dir`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..data.collate import Collator
from ..data.dataset import load_statistics
from ..data.embodiments import get_embodiment, load_embodiments
from ..data.errors import DataError
from ..data.remote import is_remote
from ..data.sampling import WindowSpec
from ..model.args import preset
from ..model.conditioning import NULL_PROMPT, encode_batch, encode_prompts
from ..outputs import check_output_dir, publish_dir
from ..progress import Progress
from .config import TrainConfig
from .encoders import frozen_encoders

CACHE_VERSION = 1


class CacheWriter:
    """Writes a cache's files into `directory` (rows in shards, one text row per unique prompt, and the null
    prompt's row `null_context` [1, text_len, text_dim]). Callers write into `outputs.publish_dir`'s temporary
    sibling, so a failed build never leaves a half cache under the real name and an existing cache is replaced
    only if dz wrote it, or with `overwrite`."""

    def __init__(self, directory: Path, null_context: torch.Tensor, shard_size: int = 256):
        self.root = Path(directory)
        self.shard_size = shard_size
        self.prompts: dict[str, int] = {}
        self.text_rows: list[torch.Tensor] = []
        self.shards: list[dict] = []
        self.pending: list[dict[str, torch.Tensor]] = []
        self.null_context = null_context.detach().cpu()  # [1, text_len, text_dim], the null prompt's embedding

    def prompt_index(self, prompt: str, context: torch.Tensor) -> int:
        """The index of a prompt's text row; `context` [text_len, text_dim] is stored the first time."""
        if prompt not in self.prompts:
            self.prompts[prompt] = len(self.prompts)
            self.text_rows.append(context.detach().cpu().unsqueeze(0))
        return self.prompts[prompt]

    def add(self, rows: dict[str, torch.Tensor]) -> None:
        """A batch of rows (each tensor [n, ...], with prompt_index [n])."""
        self.pending.append({k: v.detach().cpu() for k, v in rows.items()})
        if sum(p["prompt_index"].shape[0] for p in self.pending) >= self.shard_size:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        tensors = {k: torch.cat([p[k] for p in self.pending]) for k in self.pending[0]}
        name = f"shard_{len(self.shards):05d}.safetensors"
        save_file(tensors, str(self.root / name))
        self.shards.append({"file": name, "samples": int(tensors["prompt_index"].shape[0])})
        self.pending.clear()

    def finish(self, **index) -> None:
        self._flush()
        save_file({"context": torch.cat(self.text_rows), "null_context": self.null_context},
                  str(self.root / "text.safetensors"))
        index = {"version": CACHE_VERSION, **index, "prompts": list(self.prompts), "shards": self.shards,
                 "samples": sum(s["samples"] for s in self.shards)}
        (self.root / "index.json").write_text(json.dumps(index, indent=1))


def build_cache(cfg: TrainConfig, out_dir: str | Path, stride: int = 1, batch_size: int = 8, shard_size: int = 256,
                tokenizer=None, encoders=None, device: str = "cpu", progress: bool = True,
                overwrite: bool = False, command: str = "cache") -> Path:
    """command: whose output the cache directory is (the pipeline builds its stage's as "pipeline")."""
    from .windows import size_to_embodiment, training_windows

    check_output_dir(out_dir, overwrite=overwrite, command=command)  # before the encoders load
    cfg = size_to_embodiment(cfg)  # the same widths the trainer will build
    a = preset(cfg.preset, **cfg.model_overrides)
    emb = get_embodiment(cfg.embodiment, load_embodiments(cfg.embodiment_files))
    if emb.action_horizon != a.num_action_per_block:
        raise DataError(emb.horizon_mismatch(a.num_action_per_block, f"the model (preset {cfg.preset!r})"))
    stats = load_statistics(cfg.metadata, emb.tag)
    spec = WindowSpec(a.max_chunk_size, emb.action_horizon, 4 * a.num_frame_per_block, emb.sampling)
    datasets = [training_windows(p, emb, spec, stats, cfg, train=False) for p in cfg.datasets]  # no held-out
    if encoders is None:
        encoders = frozen_encoders(cfg, device)  # the same frozen weights the trainer builds
    if tokenizer is None:
        from ..model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(cfg.tokenizer)
    collate = Collator(tokenizer, a.text_len, a.max_state_dim, a.action_dim)
    with publish_dir(out_dir, command, overwrite=overwrite) as tmp:
        writer = CacheWriter(tmp, encode_prompts(tokenizer, encoders.text_encoder, [NULL_PROMPT], a.text_len, device),
                             shard_size)
        items = [(d, i) for d, ds in enumerate(datasets) for i in range(0, len(ds), stride)]
        bar = Progress(len(items), enabled=progress, desc="cache", unit="sample")
        with torch.no_grad():
            for start in range(0, len(items), batch_size):
                chunk = items[start:start + batch_size]
                samples = [datasets[d].sample(i, position=i) for d, i in chunk]
                batch = collate(samples)
                enc = encode_batch(a, encoders.vae, encoders.text_encoder, encoders.image_encoder,
                                   batch["images"].to(device), batch["text"].to(device), batch["text_attention_mask"].to(device))
                index = [writer.prompt_index(s["prompt"], enc.context[j]) for j, s in enumerate(samples)]
                row = {"clean_latents": enc.clean_latents, "clip_feature": enc.clip_feature,
                       "state": batch["state"], "action": batch["action"], "action_mask": batch["action_mask"],
                       "prompt_index": torch.tensor(index, dtype=torch.long),
                       "has_real_action": batch["has_real_action"]}
                if enc.y is not None:
                    row["y"] = enc.y
                writer.add(row)
                bar.update(n=len(chunk))
        bar.close()
        writer.finish(preset=cfg.preset, model_overrides=cfg.model_overrides, embodiment=emb.tag,
                      datasets=[p if is_remote(p) else str(Path(p).resolve()) for p in cfg.datasets], stride=stride,
                      heldout_episodes=cfg.heldout_episodes, metadata=str(cfg.metadata))
    return Path(out_dir)


# The fixed map of learnable synthetic caches: the same for every cache and seed, so a held-out cache (another
# seed) follows the rule its training cache taught
LEARNABLE_MAP_SEED = 20261128


def learnable_actions(clean_latents: torch.Tensor, state: torch.Tensor, chunk_rows: int, action_dim: int) -> torch.Tensor:
    """Actions [n, chunk_rows, action_dim] as a fixed function of what a policy observes: frame 0's latents pooled
    over the grid (scaled to unit variance) and the state, through one fixed random linear map and a tanh."""
    n = clean_latents.shape[0]
    pooled = clean_latents[:, :, 0].float().mean(dim=(-2, -1)) * math.sqrt(math.prod(clean_latents.shape[-2:]))
    feature = torch.cat([pooled, state.float().flatten(1)], dim=1)
    g = torch.Generator().manual_seed(LEARNABLE_MAP_SEED)
    weight = torch.randn(feature.shape[1], chunk_rows * action_dim, generator=g) / math.sqrt(feature.shape[1])
    return torch.tanh(feature @ weight).reshape(n, chunk_rows, action_dim)


def synthetic_cache(preset_name: str, out_dir: str | Path, samples: int, latent_hw: tuple[int, int] = (11, 20),
                    prompts: int = 4, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                    model_overrides: dict | None = None, progress: bool = True, overwrite: bool = False,
                    learnable: bool = False, prompt_tokens: int | None = None) -> Path:
    """A cache of `samples` random windows with a preset's real shapes (latent grid `latent_hw`, the encoders'
    output widths, `prompts` distinct prompts), stored in `dtype` as a bf16 encoder writes them. For measuring
    `dz train`'s throughput where neither data nor encoder weights are at hand (the numbers do not depend on
    the values); its index says it is synthetic. Drawn in batches of 16, so memory stays small.
    learnable: the actions follow from frame 0 and the state (`learnable_actions`) instead of being drawn, so a
    held-out cache of another seed measures what a run learned (`train.val_cache`).
    prompt_tokens: each prompt's rows zero past its own length, as `encode_prompts` leaves them: the first prompt
    `prompt_tokens` long, the others drawn from half that to it, the null prompt one row (umT5's end token);
    None: every row random."""
    from ..model.synthetic import random_inputs

    a = preset(preset_name, **(model_overrides or {}))
    if prompt_tokens is not None and not 1 <= prompt_tokens <= a.text_len:
        raise ValueError(f"prompt_tokens must be in [1, {a.text_len}] (the preset's text_len), got {prompt_tokens}")
    g = torch.Generator().manual_seed(seed)
    lengths = None
    if prompt_tokens is not None:  # from a generator of their own: the samples are those of the plain cache
        lengths = [prompt_tokens] + torch.randint(max(1, prompt_tokens // 2), prompt_tokens + 1, (prompts - 1,),
                                                  generator=torch.Generator().manual_seed(seed + 1)).tolist()
    null = torch.randn(1, a.text_len, a.text_dim, generator=g)  # a synthetic null prompt
    if lengths is not None:
        null[:, 1:] = 0
    with publish_dir(out_dir, "cache", overwrite=overwrite) as tmp:
        writer = CacheWriter(tmp, null.to(dtype))
        K, A = a.max_chunk_size, a.num_action_per_block
        bar = Progress(samples, enabled=progress, desc="cache", unit="sample")
        for start in range(0, samples, 16):
            n = min(16, samples - start)
            x = random_inputs(a, n, latent_hw, "cpu", dtype, g)
            if lengths is not None:
                for j in range(n):
                    x["context"][j, lengths[(start + j) % prompts]:] = 0
            index = [writer.prompt_index(f"synthetic prompt {(start + j) % prompts}", x["context"][j]) for j in range(n)]
            action = torch.rand(n, K * A, a.action_dim, generator=g) * 2 - 1
            state = torch.rand(n, K * a.num_state_per_block, a.max_state_dim, generator=g) * 2 - 1
            if learnable:
                action = learnable_actions(x["clean_latents"], state, K * A, a.action_dim)
            row = {"clean_latents": x["clean_latents"], "clip_feature": x["clip_feature"], "state": state,
                   "action": action, "action_mask": torch.ones_like(action, dtype=torch.bool),
                   "prompt_index": torch.tensor(index, dtype=torch.long),
                   "has_real_action": torch.ones(n, dtype=torch.bool)}
            if x["y"] is not None:
                row["y"] = x["y"]
            writer.add(row)
            bar.update(n=n)
        bar.close()
        writer.finish(preset=preset_name, model_overrides=model_overrides or {}, embodiment="synthetic",
                      datasets=[], stride=1, heldout_episodes=0, metadata=None, synthetic=True,
                      latent_hw=list(latent_hw), learnable=learnable, seed=seed, prompt_tokens=prompt_tokens)
    return Path(out_dir)


class CachedWindows(torch.utils.data.Dataset):
    """Samples of a `dz cache` directory, indexed by (0, sample index, global position) like MixtureDataset."""

    def __init__(self, cache_dir: str | Path, expect_preset: str | None = None):
        self.root = Path(cache_dir)
        index_path = self.root / "index.json"
        if not index_path.is_file():
            raise FileNotFoundError(f"{self.root}: not a dz cache (no index.json); build it with `dz cache`")
        self.index = json.loads(index_path.read_text())
        if expect_preset and self.index["preset"] != expect_preset:
            raise ValueError(f"{self.root}: cache was built for preset {self.index['preset']!r}, not {expect_preset!r}")
        text = load_file(str(self.root / "text.safetensors"))
        self.text = text["context"]
        self.null_context = text.get("null_context")  # absent in caches built before prompt dropout
        self.offsets = [0]
        for s in self.index["shards"]:
            self.offsets.append(self.offsets[-1] + s["samples"])
        self._shard_id, self._shard = -1, None

    def __len__(self) -> int:
        return self.offsets[-1]

    def _load(self, k: int) -> dict[str, torch.Tensor]:
        if k != self._shard_id:
            self._shard = load_file(str(self.root / self.index["shards"][k]["file"]))
            self._shard_id = k
        return self._shard

    def __getitem__(self, item) -> dict[str, torch.Tensor]:
        _, i, position = item if isinstance(item, tuple) else (0, item, item)
        import bisect

        k = bisect.bisect_right(self.offsets, i) - 1
        shard = self._load(k)
        j = i - self.offsets[k]
        out = {key: value[j] for key, value in shard.items()}
        out["context"] = self.text[int(out.pop("prompt_index"))]
        out["position"] = torch.tensor(position)
        return out


def collate_cached(samples: list[dict]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
