"""Reproduce reference fixtures: load `weights.*`, run on `input.*`, compare with `output.*`.

A fixture is a safetensors file whose metadata holds the config as strings
(see shared/README.md). Three kinds are recognised from the tensors they hold:
  - "dit": the WAN DiT in plain video mode (input.x, input.t, input.context)
  - "vae": the WAN2.2 VAE encode + decode (input.video)
  - "wam": the DreamZero CausalWanModel training forward and losses (input.noisy_latents, ...)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from .args import DreamZeroArgs, WanDiTArgs
from .attention import latent_layout, teacher_forcing_mask
from .objective import FlowMatchSchedule, action_timestep_ids, flow_matching_losses, tie_timestep_ids
from .state_dict import StateDictError, load_strict
from .wam import DreamZeroWAM
from .wan_dit import WanModel

TOLERANCE = 1e-4


class FixtureError(ValueError):
    """A fixture file that is missing, unreadable, of an unknown kind, or whose config is bad."""


@dataclass
class ParityResult:
    path: str
    kind: str
    errors: dict[str, float]          # name -> max abs error
    tolerance: float = TOLERANCE

    @property
    def ok(self) -> bool:
        return all(err <= self.tolerance for err in self.errors.values())

    def report(self) -> str:
        width = max(len(k) for k in self.errors) if self.errors else 10
        lines = [f"fixture {self.path} (kind: {self.kind}, tolerance {self.tolerance:g})"]
        for name, err in self.errors.items():
            lines.append(f"  {name:<{width}}  max abs err {err:.3e}  {'ok' if err <= self.tolerance else 'FAIL'}")
        lines.append("PASS" if self.ok else "FAIL")
        return "\n".join(lines)


def read_fixture(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    path = Path(path)
    if not path.is_file():
        raise FixtureError(f"fixture not found: {path}")
    try:
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise FixtureError(f"{path} is not a readable safetensors file: {exc}") from exc
    return tensors, metadata


def detect_kind(tensors: dict[str, torch.Tensor]) -> str:
    if "input.noisy_latents" in tensors:
        return "wam"
    if "input.video" in tensors:
        return "vae"
    if "input.x" in tensors:
        return "dit"
    inputs = sorted(k for k in tensors if k.startswith("input."))[:8]
    raise FixtureError("not a recognised parity fixture: expected input.x (DiT), input.video (VAE) or "
                       f"input.noisy_latents (WAM); found inputs {inputs or 'none'}")


# --- metadata parsing ------------------------------------------------------------

def _get(meta: dict[str, str], key: str, path: str) -> str:
    if key not in meta:
        raise FixtureError(f"{path}: metadata field {key!r} is missing")
    return meta[key]


def _convert(meta: dict[str, str], key: str, path: str, kind: str, fn):
    value = _get(meta, key, path)
    try:
        return fn(value)
    except ValueError:
        raise FixtureError(f"{path}: metadata field {key!r} = {value!r} is not {kind}") from None


def _int(meta, key, path, default=None) -> int:
    if default is not None and key not in meta:
        return default
    return _convert(meta, key, path, "an integer", int)


def _float(meta, key, path) -> float:
    return _convert(meta, key, path, "a number", float)


def _bool(meta, key, path, default: bool) -> bool:
    if key not in meta:
        return default
    v = meta[key].strip().lower()
    if v not in ("true", "false", "1", "0"):
        raise FixtureError(f"{path}: metadata field {key!r} = {meta[key]!r} is not a boolean")
    return v in ("true", "1")


def _ints(meta, key, path) -> tuple[int, ...]:
    return _convert(meta, key, path, "a comma-separated int list", lambda v: tuple(int(x) for x in v.split(",")))


def _dit_fields(meta: dict[str, str], path: str) -> dict:
    return dict(
        dim=_int(meta, "dim", path), ffn_dim=_int(meta, "ffn_dim", path), num_heads=_int(meta, "num_heads", path),
        num_layers=_int(meta, "num_layers", path), in_dim=_int(meta, "in_dim", path),
        out_dim=_int(meta, "out_dim", path), text_dim=_int(meta, "text_dim", path),
        text_len=_int(meta, "text_len", path), freq_dim=_int(meta, "freq_dim", path),
        patch_size=_ints(meta, "patch_size", path), eps=_float(meta, "eps", path),
        qk_norm=_bool(meta, "qk_norm", path, True), cross_attn_norm=_bool(meta, "cross_attn_norm", path, True),
    )


def dit_args_from_metadata(meta: dict[str, str], path: str = "fixture") -> WanDiTArgs:
    try:
        return WanDiTArgs(**_dit_fields(meta, path), cross_attn_type="t2v")
    except ValueError as exc:
        raise FixtureError(f"{path}: bad DiT config: {exc}") from exc


def wam_args_from_metadata(meta: dict[str, str], path: str = "fixture") -> DreamZeroArgs:
    fields = _dit_fields(meta, path)
    cross = meta.get("cross_attn_type", "i2v_cross_attn")
    if "i2v" not in cross:
        raise FixtureError(f"{path}: DreamZero fixtures use i2v cross-attention, metadata says {cross!r}")
    try:
        return DreamZeroArgs(
            **fields, cross_attn_type="i2v",
            clip_dim=_int(meta, "clip_dim", path, 1280), clip_tokens=_int(meta, "clip_tokens", path, 257),
            action_dim=_int(meta, "action_dim", path), max_state_dim=_int(meta, "max_state_dim", path),
            hidden_size=_int(meta, "hidden_size", path),
            num_frame_per_block=_int(meta, "num_frame_per_block", path),
            num_action_per_block=_int(meta, "num_action_per_block", path),
            num_state_per_block=_int(meta, "num_state_per_block", path, 1),
            max_chunk_size=_int(meta, "max_chunk_size", path),
            concat_first_frame_latent=_bool(meta, "concat_first_frame_latent", path, False),
        )
    except ValueError as exc:
        raise FixtureError(f"{path}: bad WAM config: {exc}") from exc


def _weights(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k[len("weights."):]: v for k, v in tensors.items() if k.startswith("weights.")}


def _need(tensors: dict[str, torch.Tensor], keys: list[str], path: str) -> None:
    missing = [k for k in keys if k not in tensors]
    if missing:
        raise FixtureError(f"{path}: missing tensors {missing}")


def _max_err(a: torch.Tensor, b: torch.Tensor, name: str, path: str) -> float:
    if a.shape != b.shape:
        raise FixtureError(f"{path}: {name} has shape {tuple(a.shape)}, expected {tuple(b.shape)}")
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


# --- runners ---------------------------------------------------------------------

@torch.no_grad()
def run_dit(tensors, meta, path) -> dict[str, float]:
    _need(tensors, ["input.x", "input.t", "input.context", "output.x"], path)
    model = WanModel(dit_args_from_metadata(meta, path))
    load_strict(model, _weights(tensors), source=path)
    model.eval()
    x = tensors["input.x"].float()
    batched = x.dim() == 5
    if not batched:
        x = x[None]
    context = tensors["input.context"].float()
    if context.dim() == 2:
        context = context[None]
    t = tensors["input.t"].float()
    if t.dim() == 1 and t.numel() != x.shape[0]:
        t = t[None]
    out = model(x, t, context)
    if not batched:
        out = out[0]
    return {"output.x": _max_err(out, tensors["output.x"], "output.x", path)}


@torch.no_grad()
def run_wam(tensors, meta, path) -> dict[str, float]:
    keys = ["input.noisy_latents", "input.clean_latents", "input.timestep", "input.noisy_actions",
            "input.timestep_action", "input.state", "input.context", "input.clip_feature", "input.noise",
            "input.noise_action", "input.actions", "input.action_mask", "input.has_real_action",
            "input.timestep_id", "input.timestep_action_id", "output.video_pred", "output.action_pred",
            "output.dynamics_loss", "output.action_loss", "output.loss"]
    _need(tensors, keys, path)
    args = wam_args_from_metadata(meta, path)
    model = DreamZeroWAM(args)
    load_strict(model, _weights(tensors), source=path)
    model.eval()
    t = {k[len("input."):]: v for k, v in tensors.items() if k.startswith("input.")}
    out = model(t["noisy_latents"], t["clean_latents"], t["timestep"], t["noisy_actions"], t["timestep_action"],
                t["state"], t["context"], t["clip_feature"], y=t.get("y"), attn_backend="sdpa")
    schedule = FlowMatchSchedule()
    losses = flow_matching_losses(schedule, out.video_pred, out.action_pred, t["clean_latents"], t["noise"],
                                  t["actions"], t["noise_action"], t["timestep_id"], t["timestep_action_id"],
                                  t["action_mask"], t["has_real_action"])
    errors = {
        "output.video_pred": _max_err(out.video_pred, tensors["output.video_pred"], "video_pred", path),
        "output.action_pred": _max_err(out.action_pred, tensors["output.action_pred"], "action_pred", path),
        "output.dynamics_loss": _max_err(losses.dynamics_loss, tensors["output.dynamics_loss"], "dynamics_loss", path),
        "output.action_loss": _max_err(losses.action_loss, tensors["output.action_loss"], "action_loss", path),
        "output.loss": _max_err(losses.loss, tensors["output.loss"], "loss", path),
    }
    if "output.attention_mask" in tensors:
        F_, H, W = t["noisy_latents"].shape[2:]
        layout = latent_layout(args, (H, W), F_, keep_last_clean_block=True)  # upstream's whole sequence
        mask = teacher_forcing_mask(layout)
        ref = tensors["output.attention_mask"]
        if mask.shape != ref.shape:
            raise FixtureError(f"{path}: attention mask is {tuple(ref.shape)}, our layout gives {tuple(mask.shape)}")
        errors["output.attention_mask"] = float((mask != ref.bool()).sum())  # count of differing entries
    # The objective's own pieces, recomputed from the stored draws.
    nfpb, A = args.num_frame_per_block, args.num_action_per_block
    if "timestep_id_sampled" in t:
        tied = tie_timestep_ids(t["timestep_id_sampled"], nfpb)
        errors["derived.timestep_id"] = float((tied != t["timestep_id"]).sum())
    errors["derived.timestep_action_id"] = float(
        (action_timestep_ids(t["timestep_id"], nfpb, A) != t["timestep_action_id"]).sum())
    errors["derived.timestep"] = _max_err(schedule.timestep(t["timestep_id"]), t["timestep"], "timestep", path)
    errors["derived.noisy_latents"] = _max_err(
        schedule.add_noise(t["clean_latents"], t["noise"], t["timestep_id"], dim=2), t["noisy_latents"], "noisy", path)
    errors["derived.noisy_actions"] = _max_err(
        schedule.add_noise(t["actions"], t["noise_action"], t["timestep_action_id"], dim=1), t["noisy_actions"], "noisy", path)
    if "weight_video" in t:
        errors["derived.weight_video"] = _max_err(schedule.weight(t["timestep_id"]), t["weight_video"], "w", path)
    if "weight_action" in t:
        errors["derived.weight_action"] = _max_err(schedule.weight(t["timestep_action_id"]), t["weight_action"], "w", path)
    return errors


@torch.no_grad()
def run_vae(tensors, meta, path) -> dict[str, float]:
    from .vae import run_vae_fixture

    _need(tensors, ["input.video", "output.latent_mu", "output.decoded"], path)
    try:
        outputs = run_vae_fixture(tensors, meta)
    except (KeyError, ValueError) as exc:
        raise FixtureError(f"{path}: {exc}") from exc
    return {f"output.{k}": _max_err(v, tensors[f"output.{k}"], k, path) for k, v in outputs.items()}


RUNNERS = {"dit": run_dit, "wam": run_wam, "vae": run_vae}


def run_parity(path: str | Path, tolerance: float = TOLERANCE) -> ParityResult:
    tensors, meta = read_fixture(path)
    kind = detect_kind(tensors)
    torch.manual_seed(0)
    try:
        with torch.autocast("cpu", enabled=False):
            errors = RUNNERS[kind](tensors, meta, str(path))
    except StateDictError as exc:
        raise FixtureError(str(exc)) from exc
    return ParityResult(path=str(path), kind=kind, errors=errors, tolerance=tolerance)
