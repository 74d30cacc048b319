"""Inference: denoise one block (2 latent frames + an action chunk) with a KV cache per session.

Reference §1.8. The model-level pieces (`prefill`, `denoise_velocity`) keep the training
mask's semantics exactly, so a cached block equals the teacher-forcing forward at that block
(tested): clean history is prefilled at t = 0 one unit at a time (frame 0, then whole blocks),
the noisy video and action tokens attend [history | own block | own actions | own states], and
state tokens attend only themselves (upstream's cached path lets states attend everything,
unlike its training mask; we keep the training rule).

`DreamZeroPolicy.predict_actions(obs)` wraps the frozen encoders around it: VAE latents of the
observed frames, umT5 text (per-sample padding mask), CLIP of frame 0, a few-step Euler flow
solver over the shifted sigma grid, classifier-free guidance on the video only (actions use the
conditional prediction, as upstream), and q99 un-normalisation of the actions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from ..data.transforms import NormStats  # noqa: F401  (re-exported: the policy's q99 stats)
from .conditioning import video_to_unit_range
from .objective import FlowMatchSchedule
from .wam import DreamZeroWAM
from .wan_dit import GroupedModulation, Rope

# --- model-level cached inference -------------------------------------------------------


@dataclass
class KVCache:
    """Per-layer roped K/V of the clean history [B, L_cache, H, D], and how many latent frames it holds."""

    layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    num_frames: int = 0

    def append(self, own: list[tuple[torch.Tensor, torch.Tensor]], frames: int) -> None:
        if self.layers is None:
            self.layers = [(k, v) for k, v in own]
        else:
            self.layers = [(torch.cat([ck, k], 1), torch.cat([cv, v], 1)) for (ck, cv), (k, v) in zip(self.layers, own)]
        self.num_frames += frames

    @property
    def num_tokens(self) -> int:
        return 0 if self.layers is None else self.layers[0][0].shape[1]


@dataclass
class Conditioning:
    text: torch.Tensor               # [B, text_len, dim] after text_embedding
    image: torch.Tensor | None       # [B, clip_tokens, dim] after img_emb
    y: torch.Tensor | None = None    # [B, 4+z, F_window, h, w] first-frame condition (14B only)


def _y_slice(model: DreamZeroWAM, cond: Conditioning, start: int, count: int) -> torch.Tensor | None:
    if not model.args.concat_first_frame_latent:
        return None
    if cond.y is None or cond.y.shape[2] < start + count:
        raise ValueError("the first-frame condition y does not cover the requested frames")
    return cond.y[:, :, start:start + count]


@torch.no_grad()
def prefill(model: DreamZeroWAM, cache: KVCache, latents: torch.Tensor, cond: Conditioning) -> None:
    """Append clean latent frames to the cache at t = 0: frame 0 alone, then whole blocks."""
    a = model.args
    f = latents.shape[2]
    expected = 1 if cache.num_frames == 0 else a.num_frame_per_block
    if f != expected:
        raise ValueError(f"prefill takes {expected} latent frame(s) here (cache holds {cache.num_frames}), got {f}")
    x_in = model._with_first_frame(latents, _y_slice(model, cond, cache.num_frames, f))
    tokens, grid = model.embed_video(x_in)
    B = tokens.shape[0]
    _, e0 = model.embed_time(torch.zeros(B, 1, device=tokens.device))
    e0 = GroupedModulation(e0, ((1, tokens.shape[1]),))  # one timestep for every token
    rope = model.video_rope(grid, start_frame=cache.num_frames)
    _, own = model.run_blocks(tokens, e0, rope, cond.text, cond.image, mask=None, cache=cache.layers)
    cache.append(own, f)


@torch.no_grad()
def denoise_velocity(model: DreamZeroWAM, cache: KVCache, noisy_video: torch.Tensor, noisy_actions: torch.Tensor,
                     state: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> tuple[torch.Tensor, torch.Tensor]:
    """Velocity for the next block given the cached history.

    noisy_video [B, C, nfpb, H, W]; noisy_actions [B, A, action_dim]; state [B, S, max_state_dim]; t [B]."""
    a = model.args
    if cache.num_frames < 1 or (cache.num_frames - 1) % a.num_frame_per_block:
        raise ValueError(f"the cache must hold frame 0 plus whole blocks, holds {cache.num_frames} frames")
    block = (cache.num_frames - 1) // a.num_frame_per_block
    x_in = model._with_first_frame(noisy_video, _y_slice(model, cond, cache.num_frames, a.num_frame_per_block))
    video, grid = model.embed_video(x_in)
    B, nv = video.shape[0], video.shape[1]
    A, S = a.num_action_per_block, a.num_state_per_block
    t_actions = t[:, None].expand(B, A)
    register = model.embed_register(noisy_actions, t_actions, state)
    x = torch.cat([video, register], dim=1)
    e, e0 = model.embed_time(t[:, None])
    e0 = GroupedModulation(e0, ((1, x.shape[1]),))
    rope = Rope.cat([model.video_rope(grid, start_frame=cache.num_frames), model.register_rope(block, 1)])
    n_new, n_cache = x.shape[1], cache.num_tokens
    mask = torch.ones(n_new, n_cache + n_new, dtype=torch.bool, device=x.device)
    mask[n_new - S:, : n_cache + n_new - S] = False  # state tokens attend only themselves
    x, _ = model.run_blocks(x, e0, rope, cond.text, cond.image, mask=mask, cache=cache.layers)
    video_vel = model.unpatchify(model.head(x[:, :nv], e.expand(B, nv, a.dim)), grid)
    action_vel = model.action_decoder(x[:, nv:nv + A])
    return video_vel, action_vel


@dataclass
class SolverConfig:
    num_steps: int = 16
    cfg_scale: float = 5.0
    shift: float = 5.0
    batch_cfg: bool = True   # conditional and unconditional velocity in one forward of batch 2B (same result)


def _stack(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return None if a is None else torch.cat([a, b], dim=0)


def stack_for_cfg(caches: tuple[KVCache, KVCache], conds: tuple[Conditioning, Conditioning]
                  ) -> tuple[KVCache, Conditioning]:
    """The conditional and unconditional caches and conditionings as one batch [cond; uncond]: both hold the same
    frames, so one denoiser forward of batch 2B replaces two of batch B (half the kernel launches)."""
    c, u = caches
    if c.num_frames != u.num_frames or c.num_tokens != u.num_tokens:
        raise ValueError(f"CFG caches differ: {c.num_frames} vs {u.num_frames} frames")
    both = KVCache(layers=[(torch.cat([ck, uk]), torch.cat([cv, uv])) for (ck, cv), (uk, uv) in zip(c.layers, u.layers)],
                   num_frames=c.num_frames)
    a, b = conds
    return both, Conditioning(text=_stack(a.text, b.text), image=_stack(a.image, b.image), y=_stack(a.y, b.y))


@torch.no_grad()
def sample_block(model: DreamZeroWAM, caches: tuple[KVCache, KVCache | None], conds: tuple[Conditioning, Conditioning | None],
                 state: torch.Tensor, latent_hw: tuple[int, int], solver: SolverConfig,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Euler flow solver from sigma 1 to 0. CFG (scale > 1 with an unconditional cache) on video only."""
    a = model.args
    B = state.shape[0]
    dev = state.device
    z = a.in_dim - (20 if a.concat_first_frame_latent else 0)
    video = torch.randn(B, z, a.num_frame_per_block, *latent_hw, generator=generator, device=dev)
    actions = torch.randn(B, a.num_action_per_block, a.action_dim, generator=generator, device=dev)
    sigmas = FlowMatchSchedule(shift=solver.shift).inference_sigmas(solver.num_steps).to(dev)
    dtype = model.patch_embedding.weight.dtype
    guided = solver.cfg_scale != 1.0 and caches[1] is not None and conds[1] is not None
    batched = guided and solver.batch_cfg
    if batched:
        both_cache, both_cond = stack_for_cfg(caches, conds)
        state2 = torch.cat([state, state]).to(dtype)
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        t = (s * 1000).expand(B)
        if batched:
            v2, a2 = denoise_velocity(model, both_cache, torch.cat([video, video]).to(dtype),
                                      torch.cat([actions, actions]).to(dtype), state2, (s * 1000).expand(2 * B), both_cond)
            v_video, u_video, v_action = v2[:B], v2[B:], a2[:B]
        else:
            v_video, v_action = denoise_velocity(model, caches[0], video.to(dtype), actions.to(dtype), state.to(dtype),
                                                 t, conds[0])
            if guided:
                u_video, _ = denoise_velocity(model, caches[1], video.to(dtype), actions.to(dtype), state.to(dtype), t,
                                              conds[1])
        if guided:
            v_video = u_video.float() + solver.cfg_scale * (v_video.float() - u_video.float())
        video = video + (s_next - s) * v_video.float()
        actions = actions + (s_next - s) * v_action.float()
    return video, actions


# --- policy ----------------------------------------------------------------------------


class VideoEncoder(Protocol):
    def encode(self, video: torch.Tensor) -> torch.Tensor: ...  # [B,3,T,H,W] in [-1,1] -> normalised latents


@dataclass
class _Session:
    prompt: str
    frames: torch.Tensor                     # raw frames since the reset, [1, 3, T, H, W] in [-1, 1]
    caches: tuple[KVCache, KVCache | None]
    conds: tuple[Conditioning, Conditioning | None]
    latent_hw: tuple[int, int]
    calls: int = 0


@dataclass
class DreamZeroPolicy:
    """Observation in, un-normalised action chunk out, with one KV cache per session.

    obs = {"images": uint8 [T, H, W, 3] or [H, W, 3] (views already laid out as in training),
           "state": float [state_dim], "prompt": str, "session_id": str (optional)}
    A single frame (T = 1) starts a new window (upstream LIBERO behaviour); later calls may pass
    the frames observed since the previous call (4 per latent frame) to extend the cache.
    """

    model: DreamZeroWAM
    vae: Any                 # .encode([B,3,T,H,W] in [-1,1]) -> normalised latents
    text_encoder: Any        # (ids, mask) -> [B, L, text_dim]
    tokenizer: Any           # (texts, max_length) -> (ids, mask)
    image_encoder: Any       # .encode_images([B,3,H,W] in [-1,1]) -> [B, clip_tokens, clip_dim]
    action_stats: NormStats
    state_stats: NormStats
    image_size: tuple[int, int]
    solver: SolverConfig = field(default_factory=SolverConfig)
    negative_prompt: str = ""
    seed: int = 0
    sessions: dict[str, _Session] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.model.patch_embedding.weight.device

    # -- conditioning --

    def _text(self, prompt: str) -> torch.Tensor:
        from .t5 import zero_beyond_lengths

        ids, mask = self.tokenizer([prompt], max_length=self.model.args.text_len)
        ids, mask = ids.to(self.device), mask.to(self.device)
        emb = self.text_encoder(ids, mask)
        return zero_beyond_lengths(emb, mask.sum(dim=1))

    def _conditioning(self, prompt: str, frame0: torch.Tensor, text_emb: torch.Tensor) -> Conditioning:
        clip = self.image_encoder.encode_images(frame0)
        text, image = self.model.embed_context(text_emb, clip)
        y = None
        if self.model.args.concat_first_frame_latent:
            window = (self.model.args.local_attn_size - 1) * 4 + 1
            video = torch.cat([frame0[:, :, None], frame0.new_zeros(1, 3, window - 1, *frame0.shape[-2:])], dim=2)
            lat = self._encode(video)
            msk = torch.zeros(1, 4, *lat.shape[2:], device=lat.device, dtype=lat.dtype)
            msk[:, :, 0] = 1
            y = torch.cat([msk, lat], dim=1)
        return Conditioning(text=text, image=image, y=y)

    def _encode(self, video: torch.Tensor) -> torch.Tensor:
        """VAE latents cropped to whole patches: the patch conv drops an odd last row or column anyway
        (e.g. 176 px -> 11 latent rows with 2x2 patches), and the solver's latents must match its output."""
        lat = self.vae.encode(video.to(next(self.vae.parameters()).dtype))
        _, ph, pw = self.model.args.patch_size
        h, w = lat.shape[-2:]
        return lat[..., : h - h % ph, : w - w % pw]

    def _frames(self, images: np.ndarray) -> torch.Tensor:
        arr = np.asarray(images)
        if arr.ndim == 3:
            arr = arr[None]
        if arr.ndim != 4 or arr.shape[-1] != 3 or arr.dtype != np.uint8:
            raise ValueError(f"images must be uint8 [T, H, W, 3] or [H, W, 3], got {arr.dtype} {arr.shape}")
        # the same uint8 -> [-1, 1] conversion and resize as training's conditioning
        return video_to_unit_range(torch.from_numpy(arr).to(self.device)[None], self.image_size)  # [1,3,T,H,W]

    def _reset(self, session_id: str, prompt: str, frames: torch.Tensor) -> _Session:
        last = frames[:, :, -1:]
        cond = self._conditioning(prompt, last[:, :, 0], self._text(prompt))
        neg = None
        if self.solver.cfg_scale != 1.0:
            neg = self._conditioning(prompt, last[:, :, 0], self._text(self.negative_prompt))
        caches = (KVCache(), KVCache() if neg is not None else None)
        latent0 = self._encode(last)
        for cache, c in zip(caches, (cond, neg)):
            if cache is not None:
                prefill(self.model, cache, latent0, c)
        session = _Session(prompt=prompt, frames=last, caches=caches, conds=(cond, neg),
                           latent_hw=tuple(latent0.shape[-2:]))
        self.sessions[session_id] = session
        return session

    def _extend(self, session: _Session, frames: torch.Tensor) -> bool:
        """Add new frames; prefill every newly complete block. False when the window is full.

        The session's raw frames (at most one training window, 4·(local_attn_size−1)+1) are re-encoded
        each call: the VAE is causal, so earlier latents do not change. A streaming VAE cache would
        avoid the re-encode; it is not needed at these window sizes."""
        a = self.model.args
        session.frames = torch.cat([session.frames, frames], dim=2)
        usable = 1 + 4 * ((session.frames.shape[2] - 1) // 4)
        latents = self._encode(session.frames[:, :, :usable])
        cache = session.caches[0]
        while latents.shape[2] - cache.num_frames >= a.num_frame_per_block:
            if cache.num_frames + 2 * a.num_frame_per_block > a.local_attn_size:
                return False
            block = latents[:, :, cache.num_frames:cache.num_frames + a.num_frame_per_block]
            for c, cond in zip(session.caches, session.conds):
                if c is not None:
                    prefill(self.model, c, block, cond)
        return True

    # -- the API --

    @torch.no_grad()
    def predict_actions(self, obs: dict) -> np.ndarray:
        for key in ("images", "state", "prompt"):
            if key not in obs:
                raise ValueError(f"observation is missing {key!r}")
        a = self.model.args
        sid = str(obs.get("session_id", "default"))
        prompt = str(obs["prompt"])
        frames = self._frames(obs["images"])
        session = self.sessions.get(sid)
        if session is None or session.prompt != prompt or frames.shape[2] == 1 or not self._extend(session, frames):
            session = self._reset(sid, prompt, frames)
        session.calls += 1

        state = np.asarray(obs["state"], dtype=np.float64).reshape(-1)
        if state.shape[0] != self.state_stats.q01.shape[0] or state.shape[0] > a.max_state_dim:
            raise ValueError(f"state has {state.shape[0]} dims, the policy expects {self.state_stats.q01.shape[0]}")
        s = np.zeros((1, a.num_state_per_block, a.max_state_dim), dtype=np.float32)
        s[0, :, : state.shape[0]] = self.state_stats.normalize(state)
        state_t = torch.from_numpy(s).to(self.device)

        # the noise follows the history the session holds (its raw frames), not the number of calls, so the same
        # frames give the same chunk however they were split across calls
        gen = torch.Generator(device=self.device).manual_seed(self.seed + session.frames.shape[2])
        _, actions = sample_block(self.model, session.caches, session.conds, state_t, session.latent_hw,
                                  self.solver, gen)
        n = self.action_stats.q01.shape[0]
        return self.action_stats.unnormalize(actions[0, :, :n].cpu().double().numpy())
