"""`dz cache`: run the frozen encoders once per sample window, store the results, train from them.

RLinf recomputes umT5, CLIP and two VAE encodes every step (60 % extra FLOPs on 5B). The cache stores,
per sample window: the VAE latents (+ the 14B first-frame condition), the CLIP tokens of frame 0, the
normalised state/action rows, and an index into a table of text embeddings (one per unique prompt; a
dataset has few). Windows use the deterministic eval transforms (centre crop, no colour jitter).

Trade-off: per-step augmentation (random crop, colour jitter) and re-drawing windows around every anchor
are lost; a cache holds every `stride`-th anchor. Diffusion noise and timesteps are still drawn per step.

Layout (a DVC stage can track the directory):
    index.json                 config, datasets, embodiment, stride, shards and their sizes
    text.safetensors           embeddings [P, text_len, text_dim] of the P unique prompts
    shard_00000.safetensors    clean_latents [n, z, F, h, w], clip_feature [n, T, D], state, action,
                               action_mask, prompt_index [n] (and y for first-frame models)
Built in `<out>.tmp` and renamed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..data.collate import Collator
from ..data.dataset import load_statistics
from ..data.embodiments import get_embodiment, load_embodiments
from ..data.sampling import WindowSpec
from ..model.args import preset
from ..model.conditioning import EncodedBatch, encode_batch
from .config import TrainConfig
from .encoders import frozen_encoders

CACHE_VERSION = 1


def build_cache(cfg: TrainConfig, out_dir: str | Path, stride: int = 1, batch_size: int = 8, shard_size: int = 256,
                tokenizer=None, encoders=None, device: str = "cpu", progress: bool = True) -> Path:
    from .trainer import size_to_embodiment, training_windows

    cfg = size_to_embodiment(cfg)  # the same widths the trainer will build
    a = preset(cfg.preset, **cfg.model_overrides)
    emb = get_embodiment(cfg.embodiment, load_embodiments(cfg.embodiment_files))
    stats = load_statistics(cfg.metadata, emb.tag)
    spec = WindowSpec(a.max_chunk_size, emb.action_horizon, 4 * a.num_frame_per_block, emb.sampling)
    datasets = [training_windows(p, emb, spec, stats, cfg, train=False) for p in cfg.datasets]  # no held-out
    if encoders is None:
        encoders = frozen_encoders(cfg, device)  # the same frozen weights the trainer builds
    if tokenizer is None:
        from ..model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(cfg.tokenizer)
    collate = Collator(tokenizer, a.text_len, a.max_state_dim, a.action_dim)
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    items = [(d, i) for d, ds in enumerate(datasets) for i in range(0, len(ds), stride)]
    prompts: dict[str, int] = {}
    text_rows: list[torch.Tensor] = []
    shards, pending = [], []
    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(items), desc="cache", unit="sample")
        except ImportError:
            pass

    def flush():
        if not pending:
            return
        tensors = {k: torch.cat([p[k] for p in pending]) for k in pending[0]}
        name = f"shard_{len(shards):05d}.safetensors"
        save_file(tensors, str(tmp / name))
        shards.append({"file": name, "samples": int(tensors["prompt_index"].shape[0])})
        pending.clear()

    with torch.no_grad():
        for start in range(0, len(items), batch_size):
            chunk = items[start:start + batch_size]
            samples = [datasets[d].sample(i, position=i) for d, i in chunk]
            batch = collate(samples)
            enc = encode_batch(a, encoders.vae, encoders.text_encoder, encoders.image_encoder,
                               batch["images"].to(device), batch["text"].to(device), batch["text_attention_mask"].to(device))
            index = []
            for j, s in enumerate(samples):
                if s["prompt"] not in prompts:
                    prompts[s["prompt"]] = len(prompts)
                    text_rows.append(enc.context[j:j + 1].cpu())
                index.append(prompts[s["prompt"]])
            row = {"clean_latents": enc.clean_latents.cpu(), "clip_feature": enc.clip_feature.cpu(),
                   "state": batch["state"], "action": batch["action"], "action_mask": batch["action_mask"],
                   "prompt_index": torch.tensor(index, dtype=torch.long),
                   "has_real_action": batch["has_real_action"]}
            if enc.y is not None:
                row["y"] = enc.y.cpu()
            pending.append(row)
            if sum(p["prompt_index"].shape[0] for p in pending) >= shard_size:
                flush()
            if bar is not None:
                bar.update(len(chunk))
    flush()
    if bar is not None:
        bar.close()
    save_file({"context": torch.cat(text_rows)}, str(tmp / "text.safetensors"))
    index = {"version": CACHE_VERSION, "preset": cfg.preset, "model_overrides": cfg.model_overrides,
             "embodiment": emb.tag, "datasets": [str(Path(p).resolve()) for p in cfg.datasets], "stride": stride,
             "heldout_episodes": cfg.heldout_episodes,
             "metadata": str(cfg.metadata), "prompts": list(prompts), "shards": shards,
             "samples": sum(s["samples"] for s in shards)}
    (tmp / "index.json").write_text(json.dumps(index, indent=1))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


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
        self.text = load_file(str(self.root / "text.safetensors"))["context"]
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


def encoded_from_cached(batch: dict[str, torch.Tensor], device) -> EncodedBatch:
    return EncodedBatch(clean_latents=batch["clean_latents"].to(device), context=batch["context"].to(device),
                        clip_feature=batch["clip_feature"].to(device),
                        y=batch["y"].to(device) if "y" in batch else None)

