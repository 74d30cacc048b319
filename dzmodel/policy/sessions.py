"""The policy's sessions: `DreamZeroPolicy` keeps one session (a KV cache) per episode and wraps the sampler
(`dzmodel/model/sampler.py`: the cached block denoiser and its flow solver, on tensors) with the frozen encoders: VAE
latents of the observed frames, umT5 text (per-sample padding mask), CLIP of frame 0, a few-step Euler flow
solver over the shifted sigma grid, classifier-free guidance on the video only (actions use the
conditional prediction, as upstream), and the q99 steps of the embodiment's pipeline (`data.transforms`: the
state normalised in, the actions un-normalised out). `dzmodel/model/` stays on tensors: it imports no data code.

What makes it fast (docs/performance.md measures each): CFG's two passes as one batch, umT5 once per
prompt, only new frames through the VAE, CLIP once for both CFG branches, prefill and solver replayed as
CUDA graphs per cache length, optional DiT caching (`SolverConfig.dit_steps`), bf16 weights
(`build_policy(weights_dtype=...)`), and `predict_batch` for many sessions in one forward.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..data.transforms import NormStats
from ..model.args import DreamZeroArgs, preset
from ..model.components import FrozenEncoders, build_encoders
from ..model.conditioning import video_to_unit_range
from ..model.cuda_graphs import GraphCache
from ..model.sampler import (Conditioning, KVCache, SolverConfig, check_prefill, draw_noise, prefill, prefill_kv,
                             solve, solve_two_passes, split_cfg, text_rows_for)
from ..model.t5 import UMT5_TINY
from ..model.vae import FRAMES_PER_LATENT, StreamState
from ..model.wam import DreamZeroWAM
from ..model.wan_dit import PaddedText, WanAttentionBlock
from ..model.weight_stacks import share_weight_stacks



# --- timing ----------------------------------------------------------------------------

STAGES = ("encoders", "vae", "prefill", "solver", "decode")
COMPILED_SHAPES = 64  # compiled variants of the DiT block kept (`DreamZeroPolicy.set_compile`)


class StageTimer:
    """Wall milliseconds per stage of each chunk, for `dz bench policy`'s breakdown. It synchronises CUDA at
    every stage edge, so it is off in serving (policy.timer = None)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.calls: list[dict[str, float]] = []

    def start_call(self) -> None:
        self.calls.append(dict.fromkeys(STAGES, 0.0))

    @contextmanager
    def stage(self, name: str):
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            if self.calls:
                self.calls[-1][name] += (time.perf_counter() - t0) * 1e3


# --- policy ----------------------------------------------------------------------------


@dataclass
class _Session:
    """One robot's history since its last reset. With CFG the cache and conditioning hold [cond, uncond]
    (batch 2), so its prefill and solver forwards are one batch."""

    prompt: str
    cache: KVCache
    cond: Conditioning
    latent_hw: tuple[int, int]
    vae_state: StreamState           # the causal VAE's memory: new frames are encoded without the history
    pending: torch.Tensor            # raw frames not yet in a whole 4-frame chunk [1, 3, t < 4, H, W]
    latents: torch.Tensor | None     # encoded latent frames not yet prefilled
    history: torch.Tensor | None = None  # the newest raw frames, enough to rebuild the longest context
    raw_frames: int = 1              # frames observed since the session started (seeds the noise)
    context_end: int = 1             # raw_frames up to the last frame the cache holds
    calls: int = 0
    y_state: StreamState | None = None  # 14B: the VAE stream of the first-frame condition (frame 0, then zeros)
    first_latent: torch.Tensor | None = None   # the reset frame's latent [1, z, 1, h, w] (to decode predictions)
    predicted: torch.Tensor | None = None      # the last call's predicted video latents, when `keep_video`

    @property
    def caches(self) -> tuple[KVCache, ...]:
        """The conditional cache (and the unconditional one with CFG), for inspection."""
        return tuple(self.cache.split(1))


@dataclass
class RealComparison:
    """A session's predicted block against the real frames' (`DreamZeroPolicy.compare_with_real`)."""

    round_trip: np.ndarray    # the real frames through the VAE, decoded as the prediction is, uint8 [4·nfpb, H, W, 3]
    latent_mse: float         # mean squared error of the predicted latents against the real ones
    still_latent_mse: float   # the same for "nothing moves": the reset frame's latent repeated


@dataclass
class DreamZeroPolicy:
    """Observation in, un-normalised action chunk out, with one KV cache per session.

    obs = {"images": uint8 [T, H, W, 3] or [H, W, 3] (views already laid out as in training),
           "state": float [state_dim], "prompt": str, "session_id": str (optional), "reset": bool (optional)}
    A session is one episode. Its first call (or "reset": True) starts it; later calls pass the frames observed
    since the previous call, at the model's frame rate (the training windows' frame spacing). Each chunk is
    predicted from the context a training window would hold at that moment: frame 0 then whole blocks
    (4·num_frame_per_block frames each), ending at the newest frame. New frames that are whole blocks extend the
    KV cache; otherwise (a replanning interval shorter than a block, or a full window) the context slides: it
    is rebuilt from the session's recent frames. Without "reset", a single frame (T = 1) starts a new session
    (upstream's rule for clients that send only the current frame).
    `predict_batch` runs many sessions' chunks as one batched forward (each keeps its own cache).
    """

    model: DreamZeroWAM
    vae: Any                 # .encode([B,3,T,H,W] in [-1,1], stream state) -> normalised latents
    text_encoder: Any        # (ids, mask) -> [B, L, text_dim]
    tokenizer: Any           # (texts, max_length) -> (ids, mask)
    image_encoder: Any       # .encode_images([B,3,H,W] in [-1,1]) -> [B, clip_tokens, clip_dim]
    action_stats: NormStats
    state_stats: NormStats
    image_size: tuple[int, int]
    solver: SolverConfig = field(default_factory=SolverConfig)
    negative_prompt: str = ""
    seed: int = 0
    text_cache_size: int = 64    # prompts whose umT5 embedding is kept (0: encode the prompt at every reset)
    cuda_graphs: bool = True     # prefill and solver as CUDA graphs per shape (CUDA only)
    compile: bool = False        # torch.compile the DiT block (fused elementwise work; compiles on the first call)
    timer: StageTimer | None = None
    keep_video: bool = False     # keep each session's predicted video latents (world-model previews)
    sessions: dict[str, _Session] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._texts: OrderedDict[str, tuple[torch.Tensor, int]] = OrderedDict()
        self._text_rows = 0  # text rows a conditioning keeps (`_conditioning`)
        self._vae_layouts: dict = {}  # per captured VAE start: its stream state's layout (`_encode_start`)
        self.graphs = GraphCache(enabled=self.cuda_graphs and self.device.type == "cuda")
        share_weight_stacks(self.model)  # the matmuls that read several Linears read their stacked weights as they are
        self.set_compile(self.compile)

    def set_compile(self, on: bool) -> None:
        self.compile = on
        if on:  # a compiled block per shape the graphs meet (prefill and solver, batch sizes, cache lengths, text
            # rows): dynamo's default of 8 is met by a server batching 1-8 sessions, and past it the block runs eager
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILED_SHAPES)
        self.model.block_runner = torch.compile(WanAttentionBlock.forward_with_kv, dynamic=False) if on else None

    @property
    def device(self) -> torch.device:
        return self.model.patch_embedding.weight.device

    @property
    def guided(self) -> bool:
        return self.solver.cfg_scale != 1.0

    def _stage(self, name: str):
        return self.timer.stage(name) if self.timer is not None else nullcontext()

    # -- conditioning --

    def _text(self, prompt: str) -> tuple[torch.Tensor, int]:
        """umT5 embedding [1, text_len, text_dim] of a prompt (zero past its tokens) and its token count, cached: a
        robot repeats its prompt every call."""
        from ..model.t5 import zero_beyond_lengths

        hit = self._texts.get(prompt)
        if hit is not None:
            self._texts.move_to_end(prompt)
            return hit
        ids, mask = self.tokenizer([prompt], max_length=self.model.args.text_len)
        ids, mask = ids.to(self.device), mask.to(self.device)
        tokens = mask.sum(dim=1)
        entry = zero_beyond_lengths(self.text_encoder(ids, mask), tokens), int(tokens.max())
        if self.text_cache_size > 0:
            self._texts[prompt] = entry
            while len(self._texts) > self.text_cache_size:
                self._texts.popitem(last=False)
        return entry

    def _image_tokens(self, frame0: torch.Tensor) -> torch.Tensor:
        """CLIP tokens of the first frames [B, 3, H, W]: one CUDA graph per batch size on the GPU (the image
        encoder's ~600 kernels, launched one by one, cost more host time than the GPU spends on them)."""
        if not self.graphs.enabled:
            return self.image_encoder.encode_images(frame0)
        return self.graphs.run(("clip",), lambda: lambda x: (self.image_encoder.encode_images(x),), [frame0])[0]

    def _conditioning(self, prompts: list[str], frame0: torch.Tensor) -> tuple[Conditioning, StreamState | None]:
        """Batch B of prompts and first frames [B, 3, H, W] -> the conditioning, [cond, uncond] interleaved
        (batch 2B) with CFG. CLIP and the first-frame latent are computed once for both.

        14B's first-frame condition y (frame 0, then zero frames) is encoded only as far as the cache and the next
        block need (1 + num_frame_per_block latent frames here); `_grow_y` continues it with the returned VAE
        stream state as the session grows. The VAE is causal, so this equals encoding the whole window at once."""
        pair = 2 if self.guided else 1
        with self._stage("encoders"):
            texts = [self._text(p) for p in prompts]
            if self.guided:
                neg = self._text(self.negative_prompt)
                texts = [t for pos in texts for t in (pos, neg)]
            clip = self._image_tokens(frame0).repeat_interleave(pair, 0)
            # the text's rows past the longest prompt are all one padding row: its K and V are projected once. The
            # rows kept only grow (with the longest prompt seen), so the graphs and compiled code see one shape
            self._text_rows = max(self._text_rows, text_rows_for(max(n for _, n in texts), self.model.args.text_len))
            text, image = self.model.embed_context(torch.cat([t for t, _ in texts]), clip, text_rows=self._text_rows)
            if isinstance(text, PaddedText):
                text = text.rows
        if not self.model.args.concat_first_frame_latent:
            return Conditioning(text=text, image=image), None
        with self._stage("vae"):
            B, nfpb = frame0.shape[0], self.model.args.num_frame_per_block
            video = torch.cat([frame0[:, :, None], frame0.new_zeros(B, 3, 4 * nfpb, *frame0.shape[-2:])], dim=2)
            y_state = StreamState()
            y = self._first_frame_condition(self._encode(video, y_state), first=True)
        return Conditioning(text=text, image=image, y=y.repeat_interleave(pair, 0)), y_state

    @staticmethod
    def _first_frame_condition(latents: torch.Tensor, first: bool) -> torch.Tensor:
        """[mask (4 channels: 1 on frame 0) | latents] along channels."""
        msk = torch.zeros(latents.shape[0], 4, *latents.shape[2:], device=latents.device, dtype=latents.dtype)
        if first:
            msk[:, :, 0] = 1
        return torch.cat([msk, latents], dim=1)

    def _grow_y(self, session: "_Session", frames: int) -> None:
        """Extend a session's first-frame condition y (14B) to cover `frames` latent frames."""
        cond, nfpb = session.cond, self.model.args.num_frame_per_block
        while cond.y is not None and cond.y.shape[2] < frames:
            with self._stage("vae"):
                zeros = cond.y.new_zeros(1, 3, 4 * nfpb, *self.image_size)
                more = self._first_frame_condition(self._encode(zeros, session.y_state), first=False)
            cond = Conditioning(text=cond.text, image=cond.image,
                                y=torch.cat([cond.y, more.repeat_interleave(cond.y.shape[0], 0)], dim=2))
        session.cond = cond

    def _encode(self, video: torch.Tensor, state: StreamState | None = None) -> torch.Tensor:
        """VAE latents cropped to whole patches: the patch conv drops an odd last row or column anyway
        (e.g. 176 px -> 11 latent rows with 2x2 patches), and the solver's latents must match its output.
        A stream's start (every reset) runs as a CUDA graph per shape on the GPU, its state among the outputs."""
        video = video.to(next(self.vae.parameters()).dtype)
        if self.graphs.enabled and state is not None and not state.started:
            lat = self._encode_start(video, state)
        else:
            lat = self.vae.encode(video, state)
        _, ph, pw = self.model.args.patch_size
        h, w = lat.shape[-2:]
        return lat[..., : h - h % ph, : w - w % pw]

    def _encode_start(self, video: torch.Tensor, state: StreamState) -> torch.Tensor:
        """`vae.encode` of a stream's first frames into the fresh `state`, through the graphs: the state's tensors
        are graph outputs, and its layout (which layers, which markers) is recorded when the shape is captured."""
        key = ("vae start", tuple(video.shape))

        def make():
            def fn(x):
                fresh = StreamState()
                lat = self.vae.encode(x, fresh)
                self._vae_layouts[key], tensors = fresh.flatten()
                return (lat, *tensors)
            return fn

        lat, *tensors = self.graphs.run(key, make, [video])
        state.restore(self._vae_layouts[key], tensors)
        return lat

    def _frames(self, images: np.ndarray) -> torch.Tensor:
        arr = np.asarray(images)
        if arr.ndim == 3:
            arr = arr[None]
        if arr.ndim != 4 or arr.shape[-1] != 3 or arr.dtype != np.uint8:
            raise ValueError(f"images must be uint8 [T, H, W, 3] or [H, W, 3], got {arr.dtype} {arr.shape}")
        # the same uint8 -> [-1, 1] conversion and resize as training's conditioning
        return video_to_unit_range(torch.from_numpy(arr).to(self.device)[None], self.image_size)  # [1,3,T,H,W]

    # -- cache work (captured as CUDA graphs on the GPU) --

    def _padding(self, n: int) -> int:
        """Rows to add to a batch of n so that graphs (and compiled code) see powers of two only."""
        return (1 << (n - 1).bit_length()) - n if self.graphs.enabled else 0

    def _prefill(self, cache: KVCache, latents: torch.Tensor, cond: Conditioning) -> None:
        """Prefill `latents` (batch B, repeated per CFG pair here) into `cache` (batch B·pair)."""
        pair = 2 if self.guided else 1
        latents = latents.repeat_interleave(pair, 0)
        if not self.graphs.enabled:
            prefill(self.model, cache, latents, cond)
            return
        check_prefill(self.model, cache, latents)
        kv, frames = cache.leaves(), cache.num_frames

        def make():
            def fn(*leaves):
                past = KVCache.from_leaves(leaves[:len(kv)], frames)
                own = prefill_kv(self.model, past, leaves[len(kv)], cond.rebuild(list(leaves[len(kv) + 1:])))
                return KVCache(layers=own).leaves()
            return fn

        out = self.graphs.run(("prefill", frames, cond.image is not None, cond.y is not None), make,
                              kv + [latents] + cond.tensors())
        cache.append(KVCache.from_leaves(out, 0).layers, latents.shape[2])

    def _solve(self, cache: KVCache, cond: Conditioning, state: torch.Tensor, video: torch.Tensor,
               actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(predicted video latents, actions) of one block; the actions' padding past the robot's dims stays zero."""
        action_dims = self.action_stats.q01.shape[0]
        if self.guided and not self.solver.batch_cfg:
            caches, conds = split_cfg(cache, cond)
            return solve_two_passes(self.model, caches, conds, state, video, actions, self.solver, action_dims)
        if not self.graphs.enabled:
            return solve(self.model, cache, cond, state, video, actions, self.solver, self.guided, action_dims)
        kv, frames, guided, solver = cache.leaves(), cache.num_frames, self.guided, self.solver

        def make():
            def fn(*leaves):
                c, rest = KVCache.from_leaves(leaves[:len(kv)], frames), leaves[len(kv):]
                s, v, a = rest[-3:]
                return list(solve(self.model, c, cond.rebuild(list(rest[:-3])), s, v, a, solver, guided, action_dims))
            return fn

        # action_dims is a constant of the captured graph (its real-dims mask is built inside it): part of the key
        key = ("solve", frames, guided, cond.image is not None, cond.y is not None, action_dims)
        video, actions = self.graphs.run(key, make, kv + cond.tensors() + [state, video, actions])
        return video, actions

    # -- sessions --

    @property
    def frames_per_block(self) -> int:
        """Raw frames (at the model's frame rate) one causal block covers: 4 per latent frame."""
        return FRAMES_PER_LATENT * self.model.args.num_frame_per_block

    @property
    def _history_len(self) -> int:
        """Frames a session keeps: the longest context (frame 0 and max_chunk_size - 1 blocks)."""
        return 1 + self.frames_per_block * (self.model.args.max_chunk_size - 1)

    def _context(self, history: torch.Tensor) -> torch.Tensor:
        """The training window's layout ending at the newest frame: frame 0 then as many whole blocks as the window
        holds before the block to predict (max_chunk_size - 1), as far as the history reaches."""
        fpb = self.frames_per_block
        blocks = min(self.model.args.max_chunk_size - 1, (history.shape[2] - 1) // fpb)
        return history[:, :, history.shape[2] - 1 - fpb * blocks:]

    def _reset(self, items: list[tuple[str, str, torch.Tensor, int]]) -> None:
        """(Re)start sessions (id, prompt, history, frames seen): each from the context that ends at its newest frame
        (`_context`): its first frame is prefilled as frame 0, then its whole blocks. Sessions whose contexts are
        equally long are one batch: one VAE call and one prefill per block for all of them."""
        contexts = [self._context(history) for _, _, history, _ in items]
        by_length: dict[int, list[int]] = {}
        for i, c in enumerate(contexts):
            by_length.setdefault(c.shape[2], []).append(i)
        for idx in by_length.values():
            self._reset_batch([items[i] for i in idx], [contexts[i] for i in idx])

    def _reset_batch(self, items: list[tuple[str, str, torch.Tensor, int]], contexts: list[torch.Tensor]) -> None:
        first = torch.cat([c[:, :, :1] for c in contexts])  # [B, 3, 1, H, W]
        rest = torch.cat([c[:, :, 1:] for c in contexts])   # the whole blocks after frame 0, equally many
        prompts = [p for _, p, _, _ in items]
        pad = self._padding(len(items))
        if pad:  # a captured shape per power of two, not per batch size (the extra rows are dropped below)
            first, prompts = torch.cat([first, first[-1:].expand(pad, -1, -1, -1, -1)]), prompts + prompts[-1:] * pad
            rest = torch.cat([rest, rest[-1:].expand(pad, -1, -1, -1, -1)])
        cond, y_state = self._conditioning(prompts, first[:, :, 0])
        with self._stage("vae"):
            vae_state = StreamState()
            latent0 = self._encode(first, vae_state)
        cache = KVCache()
        with self._stage("prefill"):
            self._prefill(cache, latent0, cond)
        batch = _Session(prompt="", cache=cache, cond=cond, latent_hw=tuple(latent0.shape[-2:]), vae_state=vae_state,
                         pending=first[:, :, :0], latents=None, y_state=y_state)
        # the 14B's first-frame condition grows per session (its zeros are encoded at batch 1)
        if rest.shape[2] and y_state is None and not self._extend(batch, rest):
            raise AssertionError("a context of whole blocks always fits the window")  # _context's invariant
        pair = 2 if self.guided else 1
        for i, (sid, prompt, history, seen), c, d in zip(range(len(items)), items, batch.cache.split(pair),
                                                         batch.cond.split(pair)):
            session = _Session(prompt=prompt, cache=c, cond=d, latent_hw=batch.latent_hw,
                               first_latent=latent0[i:i + 1] if self.keep_video else None,
                               vae_state=batch.vae_state.select(i), pending=batch.pending[i:i + 1],
                               latents=None if batch.latents is None else batch.latents[i:i + 1],
                               y_state=None if y_state is None else y_state.select(i),
                               history=history[:, :, -self._history_len:], raw_frames=seen, context_end=seen)
            self.sessions[sid] = session
            if rest.shape[2] and y_state is not None and not self._extend(session, rest[i:i + 1]):
                raise AssertionError("a context of whole blocks always fits the window")
            session.raw_frames = session.context_end = seen

    def _continue(self, session: _Session, frames: torch.Tensor) -> bool:
        """Extend a session's cache with new frames when they are whole blocks right after what it holds and the
        window has room for them and the block to predict; False when the context must be rebuilt instead."""
        a, fpb = self.model.args, self.frames_per_block
        blocks, rest = divmod(frames.shape[2], fpb)
        if rest or session.context_end != session.raw_frames or \
                session.cache.num_frames + a.num_frame_per_block * (blocks + 1) > a.local_attn_size:
            return False
        if not self._extend(session, frames):
            return False
        session.context_end = session.raw_frames
        return True

    def _extend(self, session: _Session, frames: torch.Tensor) -> bool:
        """Add new frames: encode only them (the VAE's stream state holds the history) and prefill every newly
        complete block. False when the window is full (the caller resets the session)."""
        a = self.model.args
        pending = torch.cat([session.pending, frames], dim=2)
        whole = pending.shape[2] - pending.shape[2] % 4
        if whole:
            with self._stage("vae"):
                new = self._encode(pending[:, :, :whole], session.vae_state)
            session.latents = new if session.latents is None else torch.cat([session.latents, new], dim=2)
        session.pending = pending[:, :, whole:]
        session.raw_frames += frames.shape[2]
        while session.latents is not None and session.latents.shape[2] >= a.num_frame_per_block:
            if session.cache.num_frames + 2 * a.num_frame_per_block > a.local_attn_size:
                return False
            block, rest = session.latents[:, :, :a.num_frame_per_block], session.latents[:, :, a.num_frame_per_block:]
            self._grow_y(session, session.cache.num_frames + 2 * a.num_frame_per_block)  # this block and the next
            with self._stage("prefill"):
                self._prefill(session.cache, block, session.cond)
            session.latents = rest if rest.shape[2] else None
        return True

    # -- the API --

    def _parse(self, obs: dict) -> tuple[str, str, torch.Tensor, torch.Tensor]:
        for key in ("images", "state", "prompt"):
            if key not in obs:
                raise ValueError(f"observation is missing {key!r}")
        a = self.model.args
        state = np.asarray(obs["state"], dtype=np.float64).reshape(-1)
        if state.shape[0] != self.state_stats.q01.shape[0] or state.shape[0] > a.max_state_dim:
            raise ValueError(f"state has {state.shape[0]} dims, the policy expects {self.state_stats.q01.shape[0]}")
        s = np.zeros((1, a.num_state_per_block, a.max_state_dim), dtype=np.float32)
        s[0, :, : state.shape[0]] = self.state_stats.normalize(state)
        return str(obs.get("session_id", "default")), str(obs["prompt"]), self._frames(obs["images"]), \
            torch.from_numpy(s).to(self.device)

    def _prediction(self, session_id: str) -> _Session:
        s = self.sessions.get(session_id)
        if s is None or s.predicted is None or s.first_latent is None:
            raise ValueError(f"session {session_id!r} has no predicted video (set keep_video and predict first)")
        return s

    def _decode_after_context(self, latents: torch.Tensor) -> np.ndarray:
        """Latents [1, z, 1 + k, h, w] starting with the context frame's -> the 4k frames after the context,
        uint8 [4k, H, W, 3] (the causal decoder needs what came first; its frame 0, the context, is dropped)."""
        video = self.vae.decode(latents.to(next(self.vae.parameters()).dtype), clamp=True)[:, :, 1:]
        return ((video[0].permute(1, 2, 3, 0).float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).cpu().numpy()

    @torch.no_grad()
    def predicted_frames(self, session_id: str) -> np.ndarray:
        """The video the last call predicted for a session (keep_video): its latent block decoded by the VAE after
        the reset frame's latent, uint8 [4·nfpb, H, W, 3]."""
        s = self._prediction(session_id)
        return self._decode_after_context(torch.cat([s.first_latent, s.predicted.to(s.first_latent.dtype)], dim=2))

    @torch.no_grad()
    def compare_with_real(self, session_id: str, frames: np.ndarray) -> RealComparison | None:
        """A session's last prediction (keep_video) against what really followed: `frames` is uint8 [1 + T, H, W, 3],
        the session's reset frame then the next real frames, laid out as the images `predict_batch` takes. They are
        encoded as the session's frames were; None when too few to cover the predicted block (an episode's end)."""
        s = self._prediction(session_id)
        needed = 1 + FRAMES_PER_LATENT * s.predicted.shape[2]
        if len(frames) < needed:
            return None
        real = self._encode(self._frames(np.asarray(frames)[:needed]))  # [1, z, 1 + nfpb, h, w]
        context, block = real[:, :, :1], real[:, :, 1:].float()

        def mse(latents: torch.Tensor) -> float:
            return float((latents.float() - block).pow(2).mean())

        return RealComparison(round_trip=self._decode_after_context(real), latent_mse=mse(s.predicted),
                              still_latent_mse=mse(context.expand_as(block)))

    def predict_actions(self, obs: dict) -> np.ndarray:
        return self.predict_batch([obs])[0]

    @torch.no_grad()
    def predict_batch(self, observations: list[dict]) -> list[np.ndarray]:
        """One action chunk per observation, each in its own session, solved as one batch (sessions whose caches
        hold the same number of frames share a forward). Equal, within float tolerance, to one call each."""
        parsed = [self._parse(obs) for obs in observations]
        ids = [sid for sid, *_ in parsed]
        if len(set(ids)) != len(ids):
            raise ValueError(f"a batch holds one observation per session; repeated: {sorted({i for i in ids if ids.count(i) > 1})}")
        if self.timer is not None:
            self.timer.start_call()
        resets = []
        for obs, (sid, prompt, frames, _) in zip(observations, parsed):
            session = self.sessions.get(sid)
            # without an explicit "reset", a single frame starts a new window (upstream's rule)
            start = bool(obs["reset"]) if "reset" in obs else frames.shape[2] == 1
            if session is None or session.prompt != prompt or start:
                resets.append((sid, prompt, frames, frames.shape[2]))
                continue
            history = torch.cat([session.history, frames], dim=2)
            seen = session.raw_frames + frames.shape[2]
            if not self._continue(session, frames):
                resets.append((sid, prompt, history, seen))  # the context slides to end at the newest frame
            else:
                session.history = history[:, :, -self._history_len:]
        if resets:
            self._reset(resets)

        groups: dict[tuple, list[int]] = {}
        for i, (sid, *_) in enumerate(parsed):
            s = self.sessions[sid]
            s.calls += 1
            groups.setdefault((s.cache.num_frames, s.latent_hw), []).append(i)
        chunks: list[torch.Tensor | None] = [None] * len(parsed)
        for (_, latent_hw), idx in groups.items():
            sessions = [self.sessions[parsed[i][0]] for i in idx]
            # the noise follows the history a session holds (its raw frames), not the number of calls, so the
            # same frames give the same chunk however they were split across calls, and batched or not
            noise = [draw_noise(self.model, 1, latent_hw, self.device,
                                torch.Generator(device=self.device).manual_seed(self.seed + s.raw_frames))
                     for s in sessions]
            states = [parsed[i][3] for i in idx]
            pad = self._padding(len(idx))
            sessions, noise, states = sessions + sessions[-1:] * pad, noise + noise[-1:] * pad, states + states[-1:] * pad
            with self._stage("solver"):
                video, actions = self._solve(KVCache.stack([s.cache for s in sessions]),
                                      Conditioning.stack([s.cond for s in sessions]), torch.cat(states),
                                      torch.cat([v for v, _ in noise]), torch.cat([a for _, a in noise]))
            for j, i in enumerate(idx):
                chunks[i] = actions[j]
                if self.keep_video:
                    sessions[j].predicted = video[j:j + 1].clone()
        with self._stage("decode"):
            n = self.action_stats.q01.shape[0]
            host = torch.stack(chunks)[:, :, :n].cpu().double().numpy()  # one device -> host copy
            return [self.action_stats.unnormalize(x) for x in host]


# --- building one ---------------------------------------------------------------------


def build_policy(model: DreamZeroWAM, encoders: FrozenEncoders, tokenizer, action_stats: NormStats,
                 state_stats: NormStats, solver: SolverConfig | None = None, negative_prompt: str = "",
                 seed: int = 0, image_size: tuple[int, int] | None = None,
                 weights_dtype: torch.dtype | None = None, cuda_graphs: bool = True) -> DreamZeroPolicy:
    """image_size: the model's input frame (H, W); default the preset's, or pass the embodiment's layout size.
    weights_dtype: cast the DiT and the encoders (torch.bfloat16 on the GPU: half the weight reads, no autocast
    copies per forward); None keeps them as loaded."""
    if weights_dtype is not None:
        model.to(weights_dtype)
        encoders.to(weights_dtype)
    return DreamZeroPolicy(model=model.eval(), vae=encoders.vae, text_encoder=encoders.text_encoder, tokenizer=tokenizer,
                           image_encoder=encoders.image_encoder, action_stats=action_stats, state_stats=state_stats,
                           image_size=tuple(image_size or encoders.spec.image_size), solver=solver or SolverConfig(),
                           negative_prompt=negative_prompt, seed=seed, cuda_graphs=cuda_graphs)


def build_tiny_policy(tokenizer_dir: str | Path, action_dims: int = 7, state_dims: int = 8,
                      solver: SolverConfig | None = None, seed: int = 0,
                      weights_dtype: torch.dtype | None = None) -> DreamZeroPolicy:
    """A complete tiny policy with random weights: for tests, the demo and smoke evals."""
    from ..model.tokenizer import build_tiny_tokenizer, load_tokenizer

    args: DreamZeroArgs = preset("tiny")  # type: ignore[assignment]
    torch.manual_seed(seed)
    model = DreamZeroWAM(args)
    tok_dir = Path(tokenizer_dir)
    if not (tok_dir / "tokenizer.json").is_file():
        build_tiny_tokenizer(tok_dir, vocab_size=UMT5_TINY.vocab)
    stats = lambda n: NormStats(q01=-np.ones(n), q99=np.ones(n))  # noqa: E731
    return build_policy(model, build_encoders("tiny"), load_tokenizer(tok_dir), stats(action_dims), stats(state_dims),
                        solver=solver or SolverConfig(num_steps=4, cfg_scale=2.0), seed=seed, weights_dtype=weights_dtype)
