"""The WAN VAEs' building blocks: causal 3D convolutions, residual and attention blocks, the spatial and temporal
resamplers (Wan2.2's avg-pool and duplicate shortcuts too), and the encoder and decoder stacks, with the stream state
that carries each causal layer's history from one chunk to the next. Module and parameter names are the checkpoints'
keys; `dzmodel/model/vae.py` assembles the VAEs from them."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

# --- streaming state ------------------------------------------------------------------


class StreamState:
    """What the causal layers remember between chunks of one encode or decode call.

    Each layer stores its own entry (keyed by the layer object): the last input frames for a
    causal conv, a "seen the first chunk" marker for the temporal resamplers. A fresh state
    means "this is the start of the video".
    """

    def __init__(self):
        self._memory: dict[nn.Module, object] = {}

    def recall(self, layer: nn.Module):
        return self._memory.get(layer)

    def remember(self, layer: nn.Module, value) -> None:
        self._memory[layer] = value

    @property
    def started(self) -> bool:
        return bool(self._memory)

    def flatten(self) -> tuple[list, list[torch.Tensor]]:
        """(layout, tensors): the state as tensors (a CUDA graph's outputs) and what rebuilds it (`restore`)."""
        layout = [(layer, None if isinstance(v, torch.Tensor) else v) for layer, v in self._memory.items()]
        return layout, [v for v in self._memory.values() if isinstance(v, torch.Tensor)]

    def restore(self, layout: list, tensors: list[torch.Tensor]) -> None:
        """Become the state that `flatten` gave (layout, tensors)."""
        it = iter(tensors)
        self._memory = {layer: next(it) if marker is None else marker for layer, marker in layout}

    def select(self, index: int) -> "StreamState":
        """The state of one sample of a batch (tensors sliced to batch 1; markers copied)."""
        out = StreamState()
        out._memory = {k: v[index:index + 1] if isinstance(v, torch.Tensor) else v for k, v in self._memory.items()}
        return out


def _run(layers: nn.Sequential, x: torch.Tensor, state: StreamState) -> torch.Tensor:
    """Apply a Sequential, giving the stream state to the layers that keep history."""
    for layer in layers:
        x = layer(x, state) if isinstance(layer, CausalConv3d) else layer(x)
    return x


def _per_frame(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Apply a 2D module to every frame of [B, C, T, H, W]."""
    b, c, t, h, w = x.shape
    y = module(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))
    return y.reshape(b, t, *y.shape[1:]).permute(0, 2, 1, 3, 4)


# --- building blocks --------------------------------------------------------------------


class CausalConv3d(nn.Conv3d):
    """Conv3d that only looks back in time: the time axis gets 2*p frames of padding in front
    and none behind (space is padded symmetrically).

    With a StreamState the front padding is filled with the last input frames of the previous
    chunks, and with zeros only before the start of the video, so chunked == whole video.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0):
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=0)
        pt, ph, pw = (padding,) * 3 if isinstance(padding, int) else padding
        self.history = 2 * pt
        self.space_pad = (pw, pw, ph, ph)

    def forward(self, x: torch.Tensor, state: StreamState | None = None) -> torch.Tensor:
        front = self.history
        if state is not None and self.history:
            past = state.recall(self)
            if past is not None:
                x = torch.cat([past, x], dim=2)
                front -= past.shape[2]
            state.remember(self, x[:, :, -self.history:].clone())
        return super().forward(F.pad(x, (*self.space_pad, front, 0)))


class RMSNorm(nn.Module):
    """Normalise each position's channel vector to unit L2 norm, times sqrt(dim) and a learned
    per-channel gain. `images` picks the gain's shape: [C,1,1] for frames, [C,1,1,1] for videos."""

    def __init__(self, dim: int, images: bool = False, channel_first: bool = True):
        super().__init__()
        self.channel_first = channel_first
        self.scale = dim**0.5
        shape = ((dim, 1, 1) if images else (dim, 1, 1, 1)) if channel_first else (dim,)
        self.gamma = nn.Parameter(torch.ones(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=1 if self.channel_first else -1) * self.scale * self.gamma


class ResidualBlock(nn.Module):
    """norm-SiLU-conv twice, plus a 1x1x1 conv shortcut when the width changes."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.residual = nn.Sequential(
            RMSNorm(in_dim), nn.SiLU(), CausalConv3d(in_dim, out_dim, 3, padding=1),
            RMSNorm(out_dim), nn.SiLU(),
            nn.Identity(),  # upstream's Dropout(0.0); kept so the second conv stays at index 6
            CausalConv3d(out_dim, out_dim, 3, padding=1),
        )
        self.shortcut = CausalConv3d(in_dim, out_dim, 1) if in_dim != out_dim else nn.Identity()

    def forward(self, x: torch.Tensor, state: StreamState) -> torch.Tensor:
        return _run(self.residual, x, state) + self.shortcut(x)


class AttentionBlock(nn.Module):
    """Single-head self-attention over the pixels of each frame (no temporal mixing, so it needs
    no stream state)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = RMSNorm(dim, images=True)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)
        nn.init.zeros_(self.proj.weight)  # upstream init: the block starts as the identity

    def forward(self, x: torch.Tensor, state: StreamState | None = None) -> torch.Tensor:
        b, c, t, h, w = x.shape
        frames = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        qkv = self.to_qkv(self.norm(frames)).reshape(b * t, 1, 3 * c, h * w)
        q, k, v = qkv.transpose(-1, -2).contiguous().chunk(3, dim=-1)  # each [bt, 1, hw, c]
        out = F.scaled_dot_product_attention(q, k, v)
        out = self.proj(out.squeeze(1).transpose(1, 2).reshape(b * t, c, h, w))
        return x + out.reshape(b, t, c, h, w).permute(0, 2, 1, 3, 4)


class Downsample(nn.Module):
    """Halve H and W (zero-pad right/bottom, 3x3 stride-2 conv per frame); with `temporal`, also
    halve time with a stride-2 causal conv.

    The temporal conv skips the first chunk (frame 0 stays a frame of its own) and afterwards
    sees each chunk preceded by the previous chunk's last frame: a chunk of 2n frames gives n.
    """

    def __init__(self, dim: int, temporal: bool):
        super().__init__()
        self.temporal = temporal
        self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, stride=2))
        if temporal:
            self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1))

    def forward(self, x: torch.Tensor, state: StreamState) -> torch.Tensor:
        x = _per_frame(self.resample, x)
        if self.temporal:
            last = state.recall(self)
            state.remember(self, x[:, :, -1:].clone())
            if last is not None:
                x = self.time_conv(torch.cat([last, x], dim=2))
        return x


class Upsample(nn.Module):
    """Double H and W (nearest-exact, then a 3x3 conv per frame); with `temporal`, first double
    time: a causal conv makes 2C channels per frame, read as two consecutive C-channel frames.

    The first latent frame is not doubled (it decodes to the video's single first frame); the
    temporal conv's causal history starts with the second latent frame.
    """

    def __init__(self, dim: int, out_dim: int, temporal: bool):
        super().__init__()
        self.temporal = temporal
        self.resample = nn.Sequential(
            nn.Upsample(scale_factor=(2.0, 2.0), mode="nearest-exact"),
            nn.Conv2d(dim, out_dim, 3, padding=1),
        )
        if temporal:
            self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0))

    def forward(self, x: torch.Tensor, state: StreamState) -> torch.Tensor:
        if self.temporal:
            if state.recall(self) is None:
                state.remember(self, True)
            else:
                b, c, t, h, w = x.shape
                x = self.time_conv(x, state).reshape(b, 2, c, t, h, w)
                x = x.permute(0, 2, 3, 1, 4, 5).reshape(b, c, t * 2, h, w)
        return _per_frame(self.resample, x)


class AvgDown3d(nn.Module):
    """Parameter-free shortcut of a Wan2.2 down stage: fold each (ft x fs x fs) neighbourhood into
    channels, then average consecutive channel groups down to `out_channels`. Time is
    zero-padded in front to a multiple of ft (so frame 0 alone is averaged with a zero frame)."""

    def __init__(self, in_channels: int, out_channels: int, factor_t: int, factor_s: int):
        super().__init__()
        folded = in_channels * factor_t * factor_s * factor_s
        if folded % out_channels:
            raise ValueError(f"AvgDown3d: {in_channels} channels x {factor_t * factor_s**2} "
                             f"does not split into {out_channels} groups")
        self.out_channels, self.factor_t, self.factor_s = out_channels, factor_t, factor_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ft, fs = self.factor_t, self.factor_s
        x = F.pad(x, (0, 0, 0, 0, (-x.shape[2]) % ft, 0))
        b, c, t, h, w = x.shape
        x = x.reshape(b, c, t // ft, ft, h // fs, fs, w // fs, fs)
        x = x.permute(0, 1, 3, 5, 7, 2, 4, 6)  # channel index = (c, dt, dh, dw)
        x = x.reshape(b, self.out_channels, -1, t // ft, h // fs, w // fs)
        return x.mean(dim=2)


class DupUp3d(nn.Module):
    """Parameter-free shortcut of a Wan2.2 up stage, the inverse layout of AvgDown3d: repeat each
    channel, then unfold channel groups into (ft x fs x fs) neighbourhoods. On the first latent
    frame the ft-1 leading frames are dropped, like the main path's temporal upsample does."""

    def __init__(self, in_channels: int, out_channels: int, factor_t: int, factor_s: int):
        super().__init__()
        unfolded = out_channels * factor_t * factor_s * factor_s
        if unfolded % in_channels:
            raise ValueError(f"DupUp3d: {out_channels} channels x {factor_t * factor_s**2} "
                             f"is not a multiple of {in_channels}")
        self.repeats = unfolded // in_channels
        self.out_channels, self.factor_t, self.factor_s = out_channels, factor_t, factor_s

    def forward(self, x: torch.Tensor, first_chunk: bool) -> torch.Tensor:
        ft, fs = self.factor_t, self.factor_s
        b, _, t, h, w = x.shape
        x = x.repeat_interleave(self.repeats, dim=1)
        x = x.reshape(b, self.out_channels, ft, fs, fs, t, h, w)
        x = x.permute(0, 1, 5, 2, 6, 3, 7, 4).reshape(b, self.out_channels, t * ft, h * fs, w * fs)
        return x[:, :, ft - 1:] if first_chunk else x


class DownStage(nn.Module):
    """Wan2.2 encoder stage: residual blocks (+ downsample), plus an AvgDown3d shortcut around them."""

    def __init__(self, in_dim: int, out_dim: int, num_blocks: int, temporal: bool, down: bool):
        super().__init__()
        self.avg_shortcut = AvgDown3d(in_dim, out_dim, 2 if temporal else 1, 2 if down else 1)
        layers: list[nn.Module] = []
        for i in range(num_blocks):
            layers.append(ResidualBlock(in_dim if i == 0 else out_dim, out_dim))
        if down:
            layers.append(Downsample(out_dim, temporal))
        self.downsamples = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, state: StreamState) -> torch.Tensor:
        out = x
        for layer in self.downsamples:
            out = layer(out, state)
        return out + self.avg_shortcut(x)


class UpStage(nn.Module):
    """Wan2.2 decoder stage: residual blocks (+ upsample), plus a DupUp3d shortcut when upsampling."""

    def __init__(self, in_dim: int, out_dim: int, num_blocks: int, temporal: bool, up: bool):
        super().__init__()
        self.avg_shortcut = DupUp3d(in_dim, out_dim, 2 if temporal else 1, 2) if up else None
        layers: list[nn.Module] = []
        for i in range(num_blocks):
            layers.append(ResidualBlock(in_dim if i == 0 else out_dim, out_dim))
        if up:
            layers.append(Upsample(out_dim, out_dim, temporal))
        self.upsamples = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, state: StreamState) -> torch.Tensor:
        first_chunk = state.recall(self) is None
        state.remember(self, True)
        out = x
        for layer in self.upsamples:
            out = layer(out, state)
        return out if self.avg_shortcut is None else out + self.avg_shortcut(x, first_chunk)


def _middle(dim: int) -> nn.Sequential:
    return nn.Sequential(ResidualBlock(dim, dim), AttentionBlock(dim), ResidualBlock(dim, dim))


def _head(dim: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(RMSNorm(dim), nn.SiLU(), CausalConv3d(dim, out_channels, 3, padding=1))


class Encoder3d(nn.Module):
    """conv1 -> down stages -> middle (res, attn, res) -> head (norm, SiLU, conv to out_channels).

    `staged=False` is the Wan2.1 layout: one flat list of residual blocks and Downsamples.
    `staged=True` is Wan2.2: one DownStage (with its avg-pool shortcut) per resolution.
    """

    def __init__(self, in_channels: int, dim: int, out_channels: int, dim_mult, num_res_blocks: int,
                 temperal_downsample, staged: bool):
        super().__init__()
        dims = [dim * m for m in (1, *dim_mult)]
        last = len(dim_mult) - 1
        self.conv1 = CausalConv3d(in_channels, dims[0], 3, padding=1)
        layers: list[nn.Module] = []
        for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:])):
            temporal = i < last and temperal_downsample[i]
            if staged:
                layers.append(DownStage(d_in, d_out, num_res_blocks, temporal, down=i != last))
                continue
            for j in range(num_res_blocks):
                layers.append(ResidualBlock(d_in if j == 0 else d_out, d_out))
            if i != last:
                layers.append(Downsample(d_out, temporal))
        self.downsamples = nn.Sequential(*layers)
        self.middle = _middle(dims[-1])
        self.head = _head(dims[-1], out_channels)

    def forward(self, x: torch.Tensor, state: StreamState) -> torch.Tensor:
        x = self.conv1(x, state)
        for layer in (*self.downsamples, *self.middle):
            x = layer(x, state)
        return _run(self.head, x, state)


class Decoder3d(nn.Module):
    """conv1 -> middle (res, attn, res) -> up stages -> head (norm, SiLU, conv to out_channels).

    `staged=False` (Wan2.1): flat list; each upsample conv halves the width, so the next stage
    starts from half of the previous stage's width. `staged=True` (Wan2.2): one UpStage (with
    its duplicate shortcut) per resolution; upsample convs keep the width.
    """

    def __init__(self, dim: int, z_dim: int, out_channels: int, dim_mult, num_res_blocks: int,
                 temperal_upsample, staged: bool):
        super().__init__()
        dims = [dim * m for m in (dim_mult[-1], *dim_mult[::-1])]
        last = len(dim_mult) - 1
        self.conv1 = CausalConv3d(z_dim, dims[0], 3, padding=1)
        self.middle = _middle(dims[0])
        layers: list[nn.Module] = []
        for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:])):
            temporal = i < last and temperal_upsample[i]
            if staged:
                layers.append(UpStage(d_in, d_out, num_res_blocks + 1, temporal, up=i != last))
                continue
            if i > 0:
                d_in //= 2  # the previous stage's upsample conv halved the width
            for j in range(num_res_blocks + 1):
                layers.append(ResidualBlock(d_in if j == 0 else d_out, d_out))
            if i != last:
                layers.append(Upsample(d_out, d_out // 2, temporal))
        self.upsamples = nn.Sequential(*layers)
        self.head = _head(dims[-1], out_channels)

    def forward(self, x: torch.Tensor, state: StreamState) -> torch.Tensor:
        x = self.conv1(x, state)
        for layer in (*self.middle, *self.upsamples):
            x = layer(x, state)
        return _run(self.head, x, state)
