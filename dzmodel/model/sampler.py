"""The sampler: one block (2 latent frames + an action chunk) denoised against a KV cache, on tensors only.

The model-level pieces (`prefill`, `denoise_velocity`) keep the training mask's semantics exactly, so a cached
block equals the teacher-forcing forward at that block (tested): clean history is prefilled at t = 0 one unit at a
time (frame 0, then whole blocks), the noisy video and action tokens attend [history | own block | own actions |
own states], and state tokens attend only themselves (upstream's cached path lets states attend everything, unlike
its training mask; we keep the training rule). `solve` runs a few-step Euler flow solver over the shifted sigma
grid, with classifier-free guidance on the video only (actions use the conditional prediction, as upstream) and
CFG's two passes as one batch. The policy (`dzmodel/policy/sessions.py`) wraps the encoders, sessions and
normalisation around it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .objective import FlowMatchSchedule
from .wam import DreamZeroWAM
from .wan_dit import GroupedModulation, PaddedText, Rope

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

    @staticmethod
    def stack(caches: list["KVCache"]) -> "KVCache":
        """Caches holding the same frames, as one batch (concatenated along the batch dim)."""
        if len(caches) == 1:
            return caches[0]
        frames = {c.num_frames for c in caches}
        if len(frames) != 1 or caches[0].layers is None:
            raise ValueError(f"only caches of equal, non-zero length stack; got {sorted(frames)} frames")
        layers = [(torch.cat([c.layers[i][0] for c in caches]), torch.cat([c.layers[i][1] for c in caches]))
                  for i in range(len(caches[0].layers))]
        return KVCache(layers=layers, num_frames=caches[0].num_frames)

    def leaves(self) -> list[torch.Tensor]:
        """k0, v0, k1, v1, ...: the flat tensor list a CUDA graph takes as inputs."""
        return [t for k, v in (self.layers or []) for t in (k, v)]

    @staticmethod
    def from_leaves(leaves, num_frames: int) -> "KVCache":
        """The inverse of `leaves` (no leaves: an empty cache)."""
        return KVCache(layers=list(zip(leaves[0::2], leaves[1::2])) or None, num_frames=num_frames)

    def split(self, size: int) -> list["KVCache"]:
        """Consecutive batch slices of `size` samples each (views)."""
        batch = self.layers[0][0].shape[0]
        return [KVCache(layers=[(k[i:i + size], v[i:i + size]) for k, v in self.layers], num_frames=self.num_frames)
                for i in range(0, batch, size)]


@dataclass
class Conditioning:
    text: torch.Tensor               # [B, T, dim] after text_embedding: the first T rows of the text_len context; with
    #                                  T < text_len the rows from T on are the embedded zero row (`block_text`)
    image: torch.Tensor | None       # [B, clip_tokens, dim] after img_emb
    y: torch.Tensor | None = None    # [B, 4+z, F_window, h, w] first-frame condition (14B only)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.text, self.image, self.y) if t is not None]

    def rebuild(self, tensors: list[torch.Tensor]) -> "Conditioning":
        """The same structure with other tensors (from `tensors()` order)."""
        it = iter(tensors)
        return Conditioning(text=next(it), image=None if self.image is None else next(it),
                            y=None if self.y is None else next(it))

    @staticmethod
    def stack(conds: list["Conditioning"]) -> "Conditioning":
        """One batch of many sessions' conditionings; texts of fewer rows are extended with their last row, a
        padding row wherever the text is shorter than text_len (`text_rows_for`)."""
        if len(conds) == 1:
            return conds[0]
        rows = max(c.text.shape[1] for c in conds)
        conds = [c if c.text.shape[1] == rows else
                 c.rebuild([torch.cat([c.text, c.text[:, -1:].expand(-1, rows - c.text.shape[1], -1)], dim=1),
                            *c.tensors()[1:]]) for c in conds]
        return conds[0].rebuild([torch.cat(ts) for ts in zip(*(c.tensors() for c in conds))])

    def split(self, size: int) -> list["Conditioning"]:
        batch = self.text.shape[0]
        return [self.rebuild([t[i:i + size] for t in self.tensors()]) for i in range(0, batch, size)]


def text_rows_for(prompt_tokens: int, text_len: int) -> int:
    """Rows of a text context to keep for prompts of up to `prompt_tokens` tokens: a power of two (a few shapes for
    the CUDA graphs and compiled code to see) above the longest prompt, so that the last row kept is always a padding
    row (`Conditioning.stack` extends shorter texts with it); text_len where that would not leave rows out."""
    rows = max(8, 1 << prompt_tokens.bit_length())
    return rows if rows < text_len else text_len


def block_text(model: DreamZeroWAM, text: torch.Tensor) -> torch.Tensor | PaddedText:
    """`Conditioning.text` as the blocks take it: the whole text_len context, or, for fewer rows, a PaddedText whose
    rows past them are the embedded zero row (the cross-attention then projects only the rows kept and the pad)."""
    n = model.args.text_len
    if text.shape[1] >= n:
        return text
    w = model.text_embedding[0].weight
    return PaddedText(text, model.text_embedding(text.new_zeros(1, 1, model.args.text_dim, dtype=w.dtype)), n)


def _y_slice(model: DreamZeroWAM, cond: Conditioning, start: int, count: int) -> torch.Tensor | None:
    if not model.args.concat_first_frame_latent:
        return None
    if cond.y is None or cond.y.shape[2] < start + count:
        raise ValueError("the first-frame condition y does not cover the requested frames")
    return cond.y[:, :, start:start + count]


@torch.no_grad()
def prefill(model: DreamZeroWAM, cache: KVCache, latents: torch.Tensor, cond: Conditioning) -> None:
    """Append clean latent frames to the cache at t = 0: frame 0 alone, then whole blocks."""
    check_prefill(model, cache, latents)
    cache.append(prefill_kv(model, cache, latents, cond), latents.shape[2])


def check_prefill(model: DreamZeroWAM, cache: KVCache, latents: torch.Tensor) -> None:
    f = latents.shape[2]
    expected = 1 if cache.num_frames == 0 else model.args.num_frame_per_block
    if f != expected:
        raise ValueError(f"prefill takes {expected} latent frame(s) here (cache holds {cache.num_frames}), got {f}")


def prefill_kv(model: DreamZeroWAM, cache: KVCache, latents: torch.Tensor, cond: Conditioning
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's roped K/V of the clean `latents` that follow the cached frames (what `prefill` appends)."""
    x_in = model._with_first_frame(latents, _y_slice(model, cond, cache.num_frames, latents.shape[2]))
    tokens, grid = model.embed_video(x_in)
    B = tokens.shape[0]
    _, e0 = model.embed_time(torch.zeros(B, 1, device=tokens.device))
    e0 = GroupedModulation(e0, ((1, tokens.shape[1]),))  # one timestep for every token
    rope = model.video_rope(grid, start_frame=cache.num_frames)
    _, own = model.run_blocks(tokens, e0, rope, block_text(model, cond.text), cond.image, mask=None,
                              cache=cache.layers)
    return own


@torch.no_grad()
def denoise_velocity(model: DreamZeroWAM, cache: KVCache, noisy_video: torch.Tensor, noisy_actions: torch.Tensor,
                     state: torch.Tensor, t: torch.Tensor, cond: Conditioning,
                     cross: list[tuple[torch.Tensor, ...]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Velocity for the next block given the cached history.

    noisy_video [B, C, nfpb, H, W]; noisy_actions [B, A, action_dim]; state [B, S, max_state_dim]; t [B];
    cross: `model.cross_kv(cond.text, cond.image)`, when the caller reuses it across steps."""
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
    text = cond.text if cross is not None else block_text(model, cond.text)  # with `cross` the blocks read no text
    x, _ = model.run_blocks(x, e0, rope, text, cond.image, mask=mask, cache=cache.layers, cross=cross)
    video_vel = model.unpatchify(model.head(x[:, :nv], e.expand(B, nv, a.dim)), grid)
    action_vel = model.action_decoder(x[:, nv:nv + A])
    return video_vel, action_vel


# upstream DreamZero's shipped schedule: 16 scheduler steps, the DiT runs on 8 and the others reuse its last velocity
UPSTREAM_DIT_STEPS = "TTTFFFTFFFTFFTTT"


@dataclass
class SolverConfig:
    num_steps: int = 16
    cfg_scale: float = 5.0
    shift: float = 5.0
    batch_cfg: bool = True   # conditional and unconditional velocity in one forward of batch 2B (same result)
    # which solver steps run the DiT ("T") and which reuse its last velocity ("F"), as upstream's DiT caching;
    # "" runs it at every step, "upstream" is upstream's 16-step schedule (8 DiT forwards)
    dit_steps: str = ""
    reuse_cross_kv: bool = True   # the context's cross-attention K/V once per chunk (False: at every step, as before)

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"solver num_steps must be >= 1, got {self.num_steps}")
        mask = self.dit_mask()
        if len(mask) != self.num_steps or not mask[0]:
            raise ValueError(f"dit_steps {self.dit_steps!r} must have one T/F per solver step ({self.num_steps}) "
                             "and start with T")

    def dit_mask(self) -> tuple[bool, ...]:
        text = UPSTREAM_DIT_STEPS if self.dit_steps == "upstream" else self.dit_steps
        if not text:
            return (True,) * self.num_steps
        if set(text) - {"T", "F"}:
            raise ValueError(f"dit_steps must be a string of T and F (or 'upstream'), got {self.dit_steps!r}")
        return tuple(c == "T" for c in text)

    @property
    def dit_forwards(self) -> int:
        return sum(self.dit_mask())

    def sigmas(self) -> list[float]:
        return FlowMatchSchedule(shift=self.shift).inference_sigmas(self.num_steps).tolist()


def interleave_cfg(caches: tuple[KVCache, KVCache], conds: tuple[Conditioning, Conditioning]
                   ) -> tuple[KVCache, Conditioning]:
    """Conditional and unconditional caches and conditionings of batch B as one batch 2B, interleaved per sample
    ([c0, u0, c1, u1, ...]): both hold the same frames, so one denoiser forward replaces two."""
    c, u = caches
    if c.num_frames != u.num_frames or c.num_tokens != u.num_tokens:
        raise ValueError(f"CFG caches differ: {c.num_frames} vs {u.num_frames} frames")

    def mix(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.stack([x, y], dim=1).flatten(0, 1)

    both = KVCache(layers=[(mix(ck, uk), mix(cv, uv)) for (ck, cv), (uk, uv) in zip(c.layers, u.layers)],
                   num_frames=c.num_frames)
    return both, conds[0].rebuild([mix(x, y) for x, y in zip(conds[0].tensors(), conds[1].tensors())])


def split_cfg(cache: KVCache, cond: Conditioning) -> tuple[tuple[KVCache, KVCache], tuple[Conditioning, Conditioning]]:
    """The inverse of `interleave_cfg`: (cond, uncond) caches and conditionings of batch B (strided views)."""
    caches = tuple(KVCache(layers=[(k[i::2], v[i::2]) for k, v in cache.layers], num_frames=cache.num_frames)
                   for i in (0, 1))
    conds = tuple(cond.rebuild([t[i::2] for t in cond.tensors()]) for i in (0, 1))
    return caches, conds  # type: ignore[return-value]


def real_action_dims(actions: torch.Tensor, action_dims: int | None) -> torch.Tensor:
    """bool [action_dim]: True on the robot's own action dims (the first `action_dims`; None: all), False on the
    padding up to the model's action_dim. Built on the actions' device (inside a CUDA graph, a captured kernel)."""
    width = actions.shape[-1]
    if action_dims is None:
        action_dims = width
    if not 1 <= action_dims <= width:
        raise ValueError(f"action_dims must be in [1, {width}] (the model's action_dim), got {action_dims}")
    return torch.arange(width, device=actions.device) < action_dims


def solve(model: DreamZeroWAM, cache: KVCache, cond: Conditioning, state: torch.Tensor, video: torch.Tensor,
          actions: torch.Tensor, solver: SolverConfig, guided: bool, action_dims: int | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Euler flow solver from sigma 1 to 0 starting at the noise (`video`, `actions`, batch B).

    guided: `cache` and `cond` hold [cond, uncond] interleaved per sample (batch 2B) and the video velocity is
    guided with `solver.cfg_scale` (actions use the conditional prediction, as upstream). Steps that the
    `dit_steps` schedule skips reuse the last velocity. action_dims: the robot's own action dims; the padding past
    them is zero from the start and after every step, as training feeds it (the model's velocity there is
    meaningless, never trained). Pure tensor work: it is what a CUDA graph captures."""
    B = video.shape[0]
    dtype = model.patch_embedding.weight.dtype
    sigmas = solver.sigmas()
    real = real_action_dims(actions, action_dims)
    actions = torch.where(real, actions, 0.0)
    pair = 2 if guided else 1
    state_in = state.to(dtype).repeat_interleave(pair, 0)
    cross = model.cross_kv(block_text(model, cond.text), cond.image) if solver.reuse_cross_kv else None  # once per chunk
    v_video = v_action = None
    for run, s, s_next in zip(solver.dit_mask(), sigmas[:-1], sigmas[1:]):
        if run:
            t = torch.full((B * pair,), s * 1000.0, device=video.device)
            vv, va = denoise_velocity(model, cache, video.to(dtype).repeat_interleave(pair, 0),
                                      actions.to(dtype).repeat_interleave(pair, 0), state_in, t, cond, cross)
            vv, va = vv.float().unflatten(0, (B, pair)), va.float().unflatten(0, (B, pair))
            v_video = vv[:, 1] + solver.cfg_scale * (vv[:, 0] - vv[:, 1]) if guided else vv[:, 0]
            v_action = torch.where(real, va[:, 0], 0.0)
        video = video + (s_next - s) * v_video
        actions = actions + (s_next - s) * v_action
    return video, actions


def solve_two_passes(model: DreamZeroWAM, caches: tuple[KVCache, KVCache], conds: tuple[Conditioning, Conditioning],
                     state: torch.Tensor, video: torch.Tensor, actions: torch.Tensor, solver: SolverConfig,
                     action_dims: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The guided solver with separate conditional and unconditional forwards (`batch_cfg=False`, the reference)."""
    dtype = model.patch_embedding.weight.dtype
    sigmas = solver.sigmas()
    real = real_action_dims(actions, action_dims)
    actions = torch.where(real, actions, 0.0)
    cross = [model.cross_kv(block_text(model, c.text), c.image) if solver.reuse_cross_kv else None for c in conds]
    for run, s, s_next in zip(solver.dit_mask(), sigmas[:-1], sigmas[1:]):
        if run:
            t = torch.full((video.shape[0],), s * 1000.0, device=video.device)
            args = (video.to(dtype), actions.to(dtype), state.to(dtype), t)
            v_video, v_action = denoise_velocity(model, caches[0], *args, conds[0], cross[0])
            u_video, _ = denoise_velocity(model, caches[1], *args, conds[1], cross[1])
            v_video = u_video.float() + solver.cfg_scale * (v_video.float() - u_video.float())
            v_action = torch.where(real, v_action.float(), 0.0)
        video = video + (s_next - s) * v_video
        actions = actions + (s_next - s) * v_action
    return video, actions


def draw_noise(model: DreamZeroWAM, batch: int, latent_hw: tuple[int, int], device: torch.device,
               generator: torch.Generator | None = None, action_dims: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The solver's starting noise: video latents and actions, the actions zero past the robot's `action_dims`
    (the real dims' noise is the same whatever `action_dims` is)."""
    a = model.args
    # the noisy latent has out_dim channels (the velocity's); 14B's in_dim adds the 4 + z first-frame condition
    video = torch.randn(batch, a.out_dim, a.num_frame_per_block, *latent_hw, generator=generator, device=device)
    actions = torch.randn(batch, a.num_action_per_block, a.action_dim, generator=generator, device=device)
    return video, torch.where(real_action_dims(actions, action_dims), actions, 0.0)
