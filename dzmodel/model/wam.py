"""DreamZero's world action model: a WAN DiT over [clean video | noisy video | actions | states].

Reference §1.1-1.6. The trainable part of DreamZero (upstream `CausalWanModel`).
State-dict keys equal upstream's (a full DreamZero checkpoint prefixes them with
`action_head.model.`), so WAN checkpoints load into the backbone and DreamZero
checkpoints load whole.

Differences from upstream, all deliberate:
- one attention call per layer with the §1.6 mask (FlexAttention or SDPA), not ~18 dense calls;
- the clean copy leaves out its last block, which only clean tokens attend (no output or gradient changes);
- the last layer computes only the rows that the loss reads, the noisy video and the actions (likewise);
- optionally (`noisy_first_frame=False`), no noisy copy of frame 0: a loss term of its own that inference never runs;
- time embeddings are computed once per frame / action / state and broadcast to tokens,
  which is the same arithmetic as upstream's per-token MLP without its L-fold repeat;
- `embodiment_id` is accepted and ignored, as upstream forces it to 0 (one projector table).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .args import DreamZeroArgs
from .attention import (AttnMask, SegmentedMask, TeacherForcingLayout, latent_layout, mask_for_queries,
                        narrows_queries, teacher_forcing_block_mask, teacher_forcing_mask)
from .packing import PackedLayout
from .wan_dit import GroupedModulation, Modulation, Rope, WanAttentionBlock, WanModel, rope_angles


class CategorySpecificLinear(nn.Module):
    """Upstream's per-embodiment linear, kept with one category: W [1, in, out], b [1, out]."""

    def __init__(self, in_dim: int, out_dim: int, num_categories: int = 1):
        super().__init__()
        self.W = nn.Parameter(0.02 * torch.randn(num_categories, in_dim, out_dim))
        self.b = nn.Parameter(torch.zeros(num_categories, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.W[0] + self.b[0]


class CategorySpecificMLP(nn.Module):
    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int):
        super().__init__()
        self.layer1 = CategorySpecificLinear(in_dim, hidden_dim)
        self.layer2 = CategorySpecificLinear(hidden_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(F.relu(self.layer1(x)))


def action_time_sinusoid(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The action encoder's time encoding: float32, [sin | cos], base 10000 (differs from WAN's)."""
    half = dim // 2
    exponent = -torch.arange(half, dtype=torch.float32, device=t.device) * (torch.log(torch.tensor(10000.0)) / half)
    angles = t.float().unsqueeze(-1) * exponent.exp()
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)


class ActionEncoder(nn.Module):
    """a = W1(action); h = swish(W2([a; sinusoid(t)])); out = W3(h). Width = model dim."""

    def __init__(self, action_dim: int, dim: int):
        super().__init__()
        self.dim = dim
        self.W1 = CategorySpecificLinear(action_dim, dim)
        self.W2 = CategorySpecificLinear(2 * dim, dim)
        self.W3 = CategorySpecificLinear(dim, dim)

    def forward(self, actions: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        a = self.W1(actions)
        tau = action_time_sinusoid(t, self.dim).to(a.dtype)
        return self.W3(F.silu(self.W2(torch.cat([a, tau], dim=-1))))


@dataclass
class WAMOutput:
    video_pred: torch.Tensor   # [B, out_dim, F, H, W] velocity for the noisy copy (F - 1 frames, from frame 1, without
    #                            its frame 0)
    action_pred: torch.Tensor  # [B, K·A, action_dim] velocity for the actions


@dataclass
class EmbeddedSequence:
    """One teacher-forcing sequence before the blocks (`DreamZeroWAM.embed_sequence`)."""

    tokens: torch.Tensor        # [B, L, dim]: clean video | noisy video | actions | states
    e0: GroupedModulation       # the time modulation per group of tokens
    rope: Rope
    e_noisy: torch.Tensor       # [B, F, dim]: the noisy frames' time embedding (for the head)
    layout: TeacherForcingLayout
    grid: tuple[int, int, int]  # the noisy copy's (frames, h, w) in tokens


class DreamZeroWAM(WanModel):
    """The DreamZero CausalWanModel: training forward (teacher forcing) and cached block inference."""

    args: DreamZeroArgs

    def __init__(self, args: DreamZeroArgs):
        super().__init__(args)
        self.state_encoder = CategorySpecificMLP(args.max_state_dim, args.hidden_size, args.dim)
        self.action_encoder = ActionEncoder(args.action_dim, args.dim)
        self.action_decoder = CategorySpecificMLP(args.dim, args.hidden_size, args.action_dim)
        # inference may swap in a compiled WanAttentionBlock.forward_with_kv (applied from outside, not a module)
        self.block_runner = None

    # -- pieces --------------------------------------------------------------

    def register_rope(self, first_block: int, num_blocks: int) -> Rope:
        """1D RoPE for the action tokens then the state tokens of blocks [first, first+num)."""
        a, dev = self.args, self.patch_embedding.weight.device
        A, S = a.num_action_per_block, a.num_state_per_block
        act_pos = torch.arange(first_block * A, (first_block + num_blocks) * A, device=dev)
        st_pos = torch.arange(first_block * S, (first_block + num_blocks) * S, device=dev)
        return Rope.cat([Rope(rope_angles(act_pos, a.head_dim, a.rope_theta)),
                         Rope(rope_angles(st_pos, a.head_dim, a.rope_theta))])

    def state_timesteps(self, timestep_action: torch.Tensor) -> torch.Tensor:
        """State token k of a block takes the block's action timestep (upstream: t_action[:, ::A/S])."""
        stride = self.args.num_action_per_block // self.args.num_state_per_block
        return timestep_action[:, ::stride]

    def embed_register(self, actions: torch.Tensor, timestep_action: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        a = self.args
        if actions.dim() != 3 or actions.shape[-1] != a.action_dim:
            raise ValueError(f"expected actions [B, K·A, {a.action_dim}], got {tuple(actions.shape)}")
        if state.dim() != 3 or state.shape[-1] != a.max_state_dim:
            raise ValueError(f"expected state [B, K·S, {a.max_state_dim}], got {tuple(state.shape)}")
        dtype = self.action_encoder.W1.W.dtype
        return torch.cat([self.action_encoder(actions.to(dtype), timestep_action),
                          self.state_encoder(state.to(dtype))], dim=1)

    def _with_first_frame(self, latents: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        if not self.args.concat_first_frame_latent:
            return latents
        if y is None:
            raise ValueError("this model concatenates the first-frame latent: y [B, 4+z, F, H, W] is required")
        return torch.cat([latents, y.to(latents.dtype)], dim=1)

    def make_mask(self, layout: TeacherForcingLayout, backend: str, device: torch.device) -> AttnMask:
        if backend == "auto":
            backend = "segments" if device.type == "cuda" else "sdpa"
        if backend == "flex":
            return teacher_forcing_block_mask(layout, device=device)
        if backend == "sdpa":
            return teacher_forcing_mask(layout, device=device)
        if backend == "segments":
            return SegmentedMask.from_layout(layout)
        raise ValueError(f"attention backend must be 'auto', 'flex', 'segments' or 'sdpa', got {backend!r}")

    # -- training forward ------------------------------------------------------

    def forward(self, noisy_latents: torch.Tensor, clean_latents: torch.Tensor, timestep: torch.Tensor,
                noisy_actions: torch.Tensor, timestep_action: torch.Tensor, state: torch.Tensor,
                context: torch.Tensor, clip_feature: torch.Tensor, y: torch.Tensor | None = None,
                embodiment_id: torch.Tensor | None = None, attn_backend: str = "auto",
                mask: AttnMask = None, residual_dtype: torch.dtype | None = None,
                noisy_first_frame: bool = True, text_rows: int | None = None) -> WAMOutput:
        """Teacher-forcing forward.

        noisy_latents, clean_latents: [B, C, F, H, W]; timestep: [B, F] (per frame, the clean copy uses 0);
        noisy_actions: [B, K·A, action_dim]; timestep_action: [B, K·A]; state: [B, K·S, max_state_dim];
        context: [B, L_txt, text_dim] (zero beyond each sample's length); clip_feature: [B, 257, clip_dim].
        residual_dtype: the dtype of the tokens between blocks (each block keeps its input's); None: as the
        embeddings give them (fp32 under autocast with fp32 weights, bf16 with bf16 weights).
        noisy_first_frame: False leaves the noisy copy of frame 0 out of the sequence (`attention` module docstring):
        video_pred then holds frames 1..F-1, and `mask` must be built for that layout.
        text_rows: every row of `context` from this one on is zero (`embed_context`): the same outputs, with the
        cross-attention's K and V projected for the rows before it and one zero row.
        """
        seq = self.embed_sequence(noisy_latents, clean_latents, timestep, noisy_actions, timestep_action, state, y,
                                  residual_dtype, noisy_first_frame)
        layout, x = seq.layout, seq.tokens
        text, image = self.embed_context(context, clip_feature, text_rows)
        if mask is None:
            mask = self.make_mask(layout, attn_backend, x.device)

        # The loss reads the noisy video and the actions only: the last block computes those rows alone (the
        # clean copy and the states still give it keys and values). The same outputs and gradients.
        c, n = layout.clean_len, layout.video_len
        rows = (c, c + n + layout.action_len)
        narrow = narrows_queries(mask)
        for i, block in enumerate(self.blocks):
            if narrow and i == len(self.blocks) - 1:
                x = block(x, seq.e0, seq.rope, text, image, mask_for_queries(mask, *rows), rows=rows)
            else:
                x = block(x, seq.e0, seq.rope, text, image, mask)
        if not narrow:
            x = x[:, rows[0]:rows[1]]
        return self.outputs(x, seq)

    def embed_sequence(self, noisy_latents: torch.Tensor, clean_latents: torch.Tensor, timestep: torch.Tensor,
                       noisy_actions: torch.Tensor, timestep_action: torch.Tensor, state: torch.Tensor,
                       y: torch.Tensor | None = None, residual_dtype: torch.dtype | None = None,
                       noisy_first_frame: bool = True) -> "EmbeddedSequence":
        """One teacher-forcing sequence's tokens [clean | noisy | actions | states], its time modulation per group
        of tokens and its RoPE tables (the arguments as `forward` takes them)."""
        if clean_latents.shape != noisy_latents.shape:
            raise ValueError(f"clean and noisy latents differ in shape: {tuple(clean_latents.shape)} vs "
                             f"{tuple(noisy_latents.shape)}")
        layout = latent_layout(self.args, tuple(noisy_latents.shape[-2:]), noisy_latents.shape[2],
                               noisy_first_frame=noisy_first_frame)
        skip = layout.num_frames - layout.noisy_frames  # latent frames the noisy copy leaves out: 0 or frame 0
        noisy, grid = self.embed_video(self._with_first_frame(noisy_latents, y)[:, :, skip:])
        # the clean copy's frames that the layout keeps (the last block's are attended by nothing that is trained)
        kept = layout.clean_frames * self.args.patch_size[0]
        clean, _ = self.embed_video(self._with_first_frame(clean_latents, y)[:, :, :kept])
        B = noisy.shape[0]
        F_, fs = grid[0] + skip, grid[1] * grid[2]
        if timestep.shape != (B, F_):
            raise ValueError(f"timestep must be [B, F] = [{B}, {F_}], got {tuple(timestep.shape)}")
        if noisy_actions.shape[1] != layout.action_len or timestep_action.shape != (B, layout.action_len):
            raise ValueError(f"{layout.num_blocks} blocks need {layout.action_len} actions and action timesteps, "
                             f"got {tuple(noisy_actions.shape)} and {tuple(timestep_action.shape)}")
        if state.shape[1] != layout.state_len:
            raise ValueError(f"{layout.num_blocks} blocks need {layout.state_len} state rows, got {state.shape[1]}")

        register = self.embed_register(noisy_actions, timestep_action, state)
        x = torch.cat([clean, noisy, register], dim=1)
        if residual_dtype is not None:
            x = x.to(residual_dtype)

        # Time embedding per group of tokens sharing a timestep (the clean video, each noisy frame, each
        # action and state), broadcast to the tokens inside the blocks.
        _, e0_clean = self.embed_time(torch.zeros_like(timestep[:, :1]))
        e_noisy, e0_noisy = self.embed_time(timestep[:, skip:])
        t_register = torch.cat([timestep_action, self.state_timesteps(timestep_action)], dim=1)
        _, e0_register = self.embed_time(t_register)
        e0 = GroupedModulation(torch.cat([e0_clean, e0_noisy, e0_register], dim=1),
                               runs=((1, layout.clean_len), (grid[0], fs), (t_register.shape[1], 1)))
        # both copies share positions (frame f has f's): the clean copy's table is a prefix, the noisy copy's from
        # its first frame on
        video_rope = self.video_rope((F_, grid[1], grid[2]))
        rope = Rope.cat([video_rope.first(layout.clean_len), video_rope.rows(skip * fs, F_ * fs),
                         self.register_rope(0, layout.num_blocks)])
        return EmbeddedSequence(x, e0, rope, e_noisy, layout, grid)

    def outputs(self, x: torch.Tensor, seq: "EmbeddedSequence") -> WAMOutput:
        """The velocities from the last block's rows [noisy video | actions] of one sequence."""
        n, fs = seq.layout.video_len, seq.grid[1] * seq.grid[2]
        video = self.head(x[:, :n], seq.e_noisy.repeat_interleave(fs, dim=1))
        action_pred = self.action_decoder(x[:, n:n + seq.layout.action_len])
        return WAMOutput(video_pred=self.unpatchify(video, seq.grid), action_pred=action_pred)

    def sequence_length(self, sample: dict) -> int:
        """Tokens of one sample's training sequence (`forward`'s keys; what a packed buffer budgets for it)."""
        latents = sample["noisy_latents"]
        return latent_layout(self.args, tuple(latents.shape[-2:]), latents.shape[2]).seq_len

    def forward_packed(self, samples: Sequence[dict], capacity: int | None = None,
                       residual_dtype: torch.dtype | None = None, attn_backend: str = "segments") -> list[WAMOutput]:
        """Several samples, each a dict of `forward`'s tensors with a batch of one, packed into one sequence of
        `capacity` tokens (default: their total): samples of different frame sizes, cameras and chunk counts
        (one action horizon: the model's). Each sample attends only its own tokens and its own context, so each
        output is the one `forward` gives the sample alone. Returns one WAMOutput per sample, in order.
        attn_backend: "segments" (one SDPA call per mask rectangle of every sample) or "flex" (one FlexAttention
        call per layer with a document mask)."""
        if not samples:
            raise ValueError("forward_packed needs at least one sample")
        if attn_backend not in ("segments", "flex"):
            raise ValueError(f"packed attention runs 'segments' or 'flex', got {attn_backend!r}")
        seqs, texts, images = [], [], []
        for i, s in enumerate(samples):
            if s["noisy_latents"].shape[0] != 1:
                raise ValueError(f"packed sample {i} has a batch of {s['noisy_latents'].shape[0]}: pack samples of "
                                 "one each")
            seqs.append(self.embed_sequence(s["noisy_latents"], s["clean_latents"], s["timestep"], s["noisy_actions"],
                                            s["timestep_action"], s["state"], s.get("y"), residual_dtype))
            text, image = self.embed_context(s["context"], s.get("clip_feature"))
            texts.append(text)
            images.append(image)
        packed = PackedLayout(tuple(q.layout for q in seqs), capacity or sum(q.layout.seq_len for q in seqs))
        pad = packed.capacity - packed.used
        x = torch.cat([q.tokens for q in seqs], dim=1)
        e0 = torch.cat([q.e0.e0 for q in seqs], dim=1)
        runs = tuple(run for q in seqs for run in q.e0.runs)
        ropes = [q.rope for q in seqs]
        if pad:  # padding tokens: zeros, the first sample's clean-copy modulation, no rotation
            x = torch.cat([x, x.new_zeros(1, pad, x.shape[-1])], dim=1)
            e0 = torch.cat([e0, e0[:, :1]], dim=1)
            runs += ((1, pad),)
            ropes.append(Rope(torch.zeros(pad, self.args.head_dim // 2, dtype=torch.float64, device=x.device)))
        text = torch.cat(texts, dim=1)
        image = torch.cat(images, dim=1) if images[0] is not None else None
        if attn_backend == "flex":
            mask = packed.block_mask(x.device)
            context_mask = functools.partial(packed.context_block_mask, device=x.device)
        else:
            mask, context_mask = packed.mask(), packed.context_mask
        cross = (context_mask([t.shape[1] for t in texts]),
                 context_mask([m.shape[1] for m in images]) if image is not None else None)
        e0_packed, rope = GroupedModulation(e0, runs), Rope.cat(ropes)
        for block in self.blocks:
            x = block(x, e0_packed, rope, text, image, mask, cross_mask=cross)
        outs = []
        for i, q in enumerate(seqs):
            start = packed.offsets[i] + q.layout.clean_len
            outs.append(self.outputs(x[:, start:start + q.layout.video_len + q.layout.action_len], q))
        return outs

    # -- cached inference --------------------------------------------------------

    def run_blocks(self, x: torch.Tensor, e0: Modulation, rope: Rope, text: torch.Tensor,
                   image: torch.Tensor | None, mask: AttnMask,
                   cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                   cross: list[tuple[torch.Tensor, ...]] | None = None,
                   ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Every layer over new tokens `x`, attending [cache | own]. Returns x and each layer's own K/V.
        cross: each layer's precomputed cross-attention context K/V (`cross_kv`), else computed here."""
        own = []
        run = self.block_runner or WanAttentionBlock.forward_with_kv
        for i, block in enumerate(self.blocks):
            x, kv = run(block, x, e0, rope, text, image, mask, None if cache is None else cache[i],
                        None if cross is None else cross[i])
            own.append(kv)
        return x, own

    def cross_kv(self, text: torch.Tensor, image: torch.Tensor | None) -> list[tuple[torch.Tensor, ...]]:
        """Every layer's cross-attention K/V of a context: the same at every solver step of a chunk."""
        return [block.cross_attn.context_kv(text, image) for block in self.blocks]
