"""Loading and saving weights: WAN component files, DreamZero HF-style directories, strict key checks.

- WAN component files: `.safetensors`, a sharded `*.safetensors.index.json`, or `.pth`/`.pt`
  read with `torch.load(weights_only=True)` (never a pickle that can run code).
- DreamZero HF-style directory: `config.json` + `model.safetensors` or
  `model.safetensors.index.json` with shards. Keys may carry upstream's `action_head.model.` prefix.
- Every load is strict: missing, unexpected and mis-shaped keys are reported together in one
  error. Loading a WAN DiT into a DreamZero model expects exactly the DreamZero-only keys to be missing.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..atomic import NEW_FILE_MODE, atomic_write_text, temp_sibling
from ..schema import SchemaError
from .args import DreamZeroArgs, WanDiTArgs

DREAMZERO_PREFIX = "action_head.model."
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# config.json and the safetensors index are kilobytes (a 14B model's index: about 100 KB)
MAX_JSON_BYTES = 16 * 2**20

# Keys a DreamZero model has that a WAN DiT checkpoint lacks (randomly initialised at cold start).
DREAMZERO_ONLY = re.compile(r"^(action_encoder|action_decoder|state_encoder)\.")
IMAGE_BRANCH = re.compile(r"^(img_emb\.|blocks\.\d+\.cross_attn\.(k_img|v_img|norm_k_img)\.)")


class StateDictError(ValueError):
    """Weights that do not fit the module: the message lists every problem."""


@dataclass
class LoadReport:
    source: str
    loaded: int = 0
    missing: list[str] = field(default_factory=list)       # expected-missing keys left at init
    unexpected: list[str] = field(default_factory=list)

    def summary(self) -> str:
        s = f"loaded {self.loaded} tensors from {self.source}"
        if self.missing:
            groups = sorted({k.split(".")[0] if not k.startswith("blocks.") else "blocks.*.cross_attn.{k_img,v_img,norm_k_img}"
                             for k in self.missing})
            s += f"; {len(self.missing)} expected-missing keys left at init ({', '.join(groups)})"
        return s


def _fmt(keys: list[str], limit: int = 8) -> str:
    return ", ".join(keys[:limit]) + (f", ... (+{len(keys) - limit} more)" if len(keys) > limit else "")


def load_strict(module: nn.Module, state: dict[str, torch.Tensor], source: str = "weights",
                allowed_missing: re.Pattern | None = None, assign: bool = False) -> LoadReport:
    """Load `state` into `module`, refusing any missing (unless `allowed_missing` matches),
    unexpected or mis-shaped key, all listed in one StateDictError."""
    own = module.state_dict()
    missing = sorted(k for k in own if k not in state)
    unexpected_missing = [k for k in missing if not (allowed_missing and allowed_missing.search(k))]
    unexpected = sorted(k for k in state if k not in own)
    mismatched = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
                  for k in sorted(own) if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    problems = []
    if unexpected_missing:
        problems.append(f"{len(unexpected_missing)} missing keys: {_fmt(unexpected_missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected keys: {_fmt(unexpected)}")
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatches: {_fmt(mismatched, 5)}")
    if problems:
        raise StateDictError(f"cannot load {source} into {type(module).__name__}:\n  " + "\n  ".join(problems))
    module.load_state_dict(state, strict=False, assign=assign)
    return LoadReport(source=source, loaded=len(state), missing=missing, unexpected=unexpected)


# --- reading files ------------------------------------------------------------------

def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a state dict from .safetensors, a safetensors index .json, or .pth/.pt (weights_only)."""
    path = Path(path)
    if path.is_dir():
        if (path / INDEX_NAME).is_file():
            return read_weights(path / INDEX_NAME)
        if (path / WEIGHTS_NAME).is_file():
            return read_weights(path / WEIGHTS_NAME)
        raise FileNotFoundError(f"{path}: no {WEIGHTS_NAME} or {INDEX_NAME} in this directory")
    if not path.is_file():
        raise FileNotFoundError(f"weight file not found: {path}")
    name = path.name
    try:
        if name.endswith(".safetensors"):
            return load_file(str(path))
        if name.endswith(".json"):
            state: dict[str, torch.Tensor] = {}
            for shard in _index_shards(path):
                state.update(load_file(str(path.parent / shard)))
            return state
        if name.endswith((".pth", ".pt", ".bin")):
            obj = torch.load(str(path), map_location="cpu", weights_only=True)
            if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
                obj = obj["state_dict"]
            if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
                raise StateDictError(f"{path}: does not hold a flat tensor state dict")
            return obj
    except SafetensorError as exc:
        raise StateDictError(f"{path}: not a valid safetensors file: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise StateDictError(f"{path}: not valid JSON: {exc}") from exc
    except (RuntimeError, pickle.UnpicklingError) as exc:  # torch.load: bad zip, or a pickle weights_only refused
        raise StateDictError(f"{path}: cannot read with torch.load(weights_only=True): {exc}") from exc
    raise StateDictError(f"{path}: unsupported weight file type (want .safetensors, .safetensors.index.json, .pth)")


def _small_json(path: Path, what: str):
    """A small JSON file (a config or an index: kilobytes; at most MAX_JSON_BYTES)."""
    with open(path, "rb") as f:
        data = f.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise StateDictError(f"{path}: larger than the {MAX_JSON_BYTES // 2**20} MiB {what} may hold")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, nesting
        raise StateDictError(f"{path}: not valid JSON: {str(exc)[:200]}") from None


def _index_shards(path: Path) -> list[str]:
    """The shard files a safetensors index names: plain file names beside the index, each a regular file there."""
    index = _small_json(path, "a safetensors index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise StateDictError(f"{path}: not a safetensors index (no 'weight_map' mapping of tensor names to files)")
    shards = set()
    for key, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard or shard in (".", "..") or "\\" in shard:
            raise StateDictError(f"{path}: weight_map.{str(key)[:100]}: a shard must be a file name beside the "
                                 f"index, got {str(shard)[:100]!r}")
        shards.add(shard)
    for shard in sorted(shards):
        shard_path = path.parent / shard
        if not shard_path.is_file():  # a FIFO or a device is never opened
            raise FileNotFoundError(f"{path}: shard {shard} listed in the index is missing")
    return sorted(shards)


def strip_prefix(state: dict[str, torch.Tensor], prefix: str = DREAMZERO_PREFIX) -> dict[str, torch.Tensor]:
    """Keep only `prefix` keys (stripped) when any key has it; else return state unchanged."""
    if not any(k.startswith(prefix) for k in state):
        return state
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def load_wan_dit(model: nn.Module, path: str | Path) -> LoadReport:
    """Load a public WAN DiT checkpoint into a WanModel or a DreamZeroWAM (cold start).

    For a DreamZero model the action/state modules are expected to be missing, and, when the WAN
    checkpoint is text-only (Wan2.2-TI2V-5B), so is the image cross-attention branch."""
    state = read_weights(path)
    allowed = None
    if hasattr(model, "action_encoder"):
        has_image = any(IMAGE_BRANCH.search(k) for k in state)
        allowed = DREAMZERO_ONLY if has_image else re.compile(f"{DREAMZERO_ONLY.pattern}|{IMAGE_BRANCH.pattern}")
    return load_strict(model, state, source=str(path), allowed_missing=allowed)


# --- DreamZero HF-style directories ------------------------------------------------------

def _sort_header(path: Path) -> None:
    """Rewrite a safetensors file's JSON header with its keys sorted, in place. safetensors writes its metadata
    from a hash map, in an order that changes from one write to the next, so the same tensors gave files with
    other checksums (and a bundle packaged twice looked like another policy). Same content, same length."""
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        sorted_header = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        if len(sorted_header) <= size:
            f.seek(8)
            f.write(sorted_header + b" " * (size - len(sorted_header)))


def save_safetensors_atomic(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """The tensors and metadata as a safetensors file, written atomically; the same tensors give the same bytes."""
    tmp = temp_sibling(path)
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        _sort_header(Path(tmp))
        os.chmod(tmp, NEW_FILE_MODE)  # safetensors >= 0.8 replaces the file with its own 0600 temporary
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_dreamzero_dir(model: nn.Module, out_dir: str | Path, max_shard_bytes: int = 5 * 2**30,
                       dtype: torch.dtype | None = None) -> Path:
    """Write config.json + model.safetensors (sharded with an index above max_shard_bytes). Pickle-free."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    args: WanDiTArgs = model.args  # type: ignore[assignment]
    state = {k: (v.to(dtype) if dtype else v).detach().contiguous().cpu() for k, v in model.state_dict().items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in state.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_safetensors_atomic(shards[0], out / WEIGHTS_NAME, meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_safetensors_atomic(shard, out / name, meta)
            weight_map.update({k: name for k in shard})
        total = sum(v.numel() * v.element_size() for v in state.values())
        atomic_write_text(out / INDEX_NAME, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config = {"model_class": type(model).__name__, "args": args.to_dict()}
    atomic_write_text(out / CONFIG_NAME, json.dumps(config, indent=2))
    return out


def read_config(model_dir: str | Path) -> WanDiTArgs:
    path = Path(model_dir) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir}: no {CONFIG_NAME} (not a DreamZero model directory)")
    config = _small_json(path, "a model config")
    if not isinstance(config, dict):
        raise StateDictError(f"{path}: expected a mapping of the model class and its args")
    args = config.get("args", config)
    cls = WanDiTArgs if config.get("model_class") == "WanModel" else DreamZeroArgs
    try:  # every dimension typed and in range, and the model within max_model_bytes, before anything is built
        return cls.from_dict(args)
    except SchemaError as exc:
        raise StateDictError(f"{path}: " + "; ".join(exc.problems)) from None
    except (TypeError, ValueError) as exc:
        raise StateDictError(f"{path}: {exc}") from None


def load_dreamzero_dir(model_dir: str | Path, device: torch.device | str = "cpu") -> nn.Module:
    """Build the model from config.json and load its weights strictly."""
    from .wam import DreamZeroWAM
    from .wan_dit import WanModel

    args = read_config(model_dir)
    with torch.device("meta"):
        model = DreamZeroWAM(args) if isinstance(args, DreamZeroArgs) else WanModel(args)
    state = strip_prefix(read_weights(model_dir))
    load_strict(model, state, source=str(model_dir), assign=True)
    return model.to(device)
