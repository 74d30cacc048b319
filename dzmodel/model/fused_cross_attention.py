"""The i2v cross-attention as one Triton kernel forward and one backward, for training on the GPU.

WAN's cross-attention gives every video token two softmaxes, one over the prompt's token rows and one over the CLIP
image's, and sums the two outputs. As two SDPA calls, each reads the queries and writes an output, and each backward
reads them again with the output gradient, runs its own dO·O pass and converts its own fp32 dQ: at the small preset's
libero_object shape that is 1.2 ms a layer, about a ninth of the training step, for very little arithmetic (the keys
are a few dozen rows). Here both softmaxes run in one kernel that holds all keys of a (sample, head) on chip: the
forward reads q once and writes o once, the backward reads q and dO once and writes dQ once (no dO·O pass: the row
sums come from the recomputed probabilities), and accumulates dK and dV on chip.

The prompt's rows beyond its length are WAN's zero padding, so after the text embedding they are identical rows.
Attending n identical rows is attending one of them with n times its weight, which is a score offset of log n. So
`text_rows` = T keeps rows [0, T) and gives row T-1 (padding in every sample: T is above the longest prompt) the
weight of itself and the text_len - T rows left out. The outputs and the gradients that reach the text embedding are
those of attending all rows (tests hold them equal in float64); the caller guarantees that rows >= T - 1 are padding
(`context_rows_needed`).

`cross_attention` dispatches: the kernels for CUDA tensors where Triton is installed, else the same arithmetic in
torch (`reference_cross_attention`, the CPU path and the tests' reference).
"""

from __future__ import annotations

import math

import torch

try:  # Triton comes with torch's CUDA wheels; the CPU install has none and needs none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = tl = None


def context_rows_needed(context: torch.Tensor, multiple: int = 16) -> int:
    """T for `text_rows`: past the last non-zero row of any sample of `context` [N, L, C], so that row T - 1 and all
    after it are padding, rounded up to `multiple` (the kernel's key tile) and at most L. One host sync: call it
    once on the run's contexts, not per step."""
    if context.dim() != 3:
        raise ValueError(f"context must be [N, L, C], got {tuple(context.shape)}")
    rows = context.shape[1]
    used = context.ne(0).any(dim=-1)                       # [N, L]
    last = int((used * torch.arange(1, rows + 1, device=context.device)).amax()) if used.numel() else 0
    return min(rows, -(-(last + 1) // multiple) * multiple)


def reference_cross_attention(q: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, ki: torch.Tensor,
                              vi: torch.Tensor, pad_count: int = 1) -> torch.Tensor:
    """Attn(q, text) + Attn(q, image) with text row T-1 weighted `pad_count` times. [B, L, H, D] in and out."""
    q, kt, vt, ki, vi = (t.transpose(1, 2) for t in (q, kt, vt, ki, vi))
    bias = None
    if pad_count != 1:
        bias = torch.zeros(kt.shape[2], dtype=q.dtype, device=q.device)
        bias[-1] = math.log(pad_count)
    text = torch.nn.functional.scaled_dot_product_attention(q, kt, vt, attn_mask=None if bias is None else bias[None])
    image = torch.nn.functional.scaled_dot_product_attention(q, ki, vi)
    return (text + image).transpose(1, 2)


def kernels_available(*tensors: torch.Tensor) -> bool:
    return triton is not None and all(t.is_cuda for t in tensors)


def kernel_fits(text_rows: int, image_rows: int, head_dim: int) -> bool:
    """Whether one (sample, head)'s keys and their gradients fit on chip: a power-of-two head dim, text keys up to
    128 x 64 and image keys up to 64 x 64 (the small preset: up to 128 and 17 rows of 64 dims). Larger contexts
    (the 5B's 257 CLIP tokens of 128 dims) keep the SDPA calls."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return False
    return _pow2(text_rows) * head_dim <= 128 * 64 and _pow2(image_rows) * head_dim <= 64 * 64


def _pow2(n: int) -> int:
    return max(16, 1 << (max(n, 1) - 1).bit_length())


if triton is not None:

    @triton.jit
    def _scores(q, k, offs_k, n_keys, scale, last_bias):
        """Scores [M, K] of q against k, the last key offset by `last_bias`, keys past n_keys at -inf."""
        s = tl.dot(q, tl.trans(k)) * scale
        s += tl.where(offs_k == n_keys - 1, last_bias, 0.0)[None, :]
        return tl.where((offs_k < n_keys)[None, :], s, float("-inf"))

    @triton.jit
    def _load_rows(ptr, stride_row, offs_row, n_rows, offs_d):
        return tl.load(ptr + offs_row[:, None] * stride_row + offs_d[None, :], mask=offs_row[:, None] < n_rows,
                       other=0.0)

    @triton.jit
    def _cross_fwd(Q, KT, VT, KI, VI, O, LSE,
                   sq_b, sq_l, sq_h, skt_b, skt_l, skt_h, svt_b, svt_l, svt_h,
                   ski_b, ski_l, ski_h, svi_b, svi_l, svi_h, so_b, so_l, so_h,
                   L, T, I, H, scale, text_bias,
                   BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr, D: tl.constexpr):
        pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
        b, h = (pid_bh // H).to(tl.int64), (pid_bh % H).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d, offs_t, offs_i = tl.arange(0, D), tl.arange(0, BLOCK_T), tl.arange(0, BLOCK_I)
        q = _load_rows(Q + b * sq_b + h * sq_h, sq_l, offs_m, L, offs_d)
        kt = _load_rows(KT + b * skt_b + h * skt_h, skt_l, offs_t, T, offs_d)
        vt = _load_rows(VT + b * svt_b + h * svt_h, svt_l, offs_t, T, offs_d)
        ki = _load_rows(KI + b * ski_b + h * ski_h, ski_l, offs_i, I, offs_d)
        vi = _load_rows(VI + b * svi_b + h * svi_h, svi_l, offs_i, I, offs_d)

        s = _scores(q, kt, offs_t, T, scale, text_bias)
        m = tl.max(s, 1)
        p = tl.exp(s - m[:, None])
        l_sum = tl.sum(p, 1)
        o = tl.dot((p / l_sum[:, None]).to(vt.dtype), vt)
        lse_t = m + tl.log(l_sum)

        s = _scores(q, ki, offs_i, I, scale, 0.0)
        m = tl.max(s, 1)
        p = tl.exp(s - m[:, None])
        l_sum = tl.sum(p, 1)
        o += tl.dot((p / l_sum[:, None]).to(vi.dtype), vi)
        lse_i = m + tl.log(l_sum)

        row = offs_m < L
        tl.store(O + b * so_b + h * so_h + offs_m[:, None] * so_l + offs_d[None, :], o.to(O.dtype.element_ty),
                 mask=row[:, None])
        lse = LSE + (pid_bh * 2) * L  # [B·H, 2, L]: text, image
        tl.store(lse + offs_m, lse_t, mask=row)
        tl.store(lse + L + offs_m, lse_i, mask=row)

    @triton.jit
    def _softmax_grads(q, do, k, v, lse, offs_k, n_keys, scale, last_bias):
        """One softmax's probabilities and score gradients for a tile of queries (recomputed from q and the saved
        log-sum-exp): P [M, K] and dS [M, K] (the scale not applied)."""
        p = tl.exp(_scores(q, k, offs_k, n_keys, scale, last_bias) - lse[:, None])
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - tl.sum(p * dp, 1)[:, None])
        return p, ds

    @triton.jit
    def _cross_bwd(Q, KT, VT, KI, VI, DO, LSE, DQ, DKT, DVT, DKI, DVI,
                   sq_b, sq_l, sq_h, skt_b, skt_l, skt_h, svt_b, svt_l, svt_h,
                   ski_b, ski_l, ski_h, svi_b, svi_l, svi_h, sdo_b, sdo_l, sdo_h, sdq_b, sdq_l, sdq_h,
                   L, T, I, H, scale, text_bias, SPLIT,
                   BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr, D: tl.constexpr):
        """Program (b·H + h, s): query tiles s, s + SPLIT, ...; dK and dV of those tiles into partial sums
        [SPLIT, B·H, BLOCK, D] (fp32), which the caller adds."""
        pid_bh, pid_s = tl.program_id(0), tl.program_id(1)
        b, h = (pid_bh // H).to(tl.int64), (pid_bh % H).to(tl.int64)
        offs_d, offs_t, offs_i = tl.arange(0, D), tl.arange(0, BLOCK_T), tl.arange(0, BLOCK_I)
        kt = _load_rows(KT + b * skt_b + h * skt_h, skt_l, offs_t, T, offs_d)
        vt = _load_rows(VT + b * svt_b + h * svt_h, svt_l, offs_t, T, offs_d)
        ki = _load_rows(KI + b * ski_b + h * ski_h, ski_l, offs_i, I, offs_d)
        vi = _load_rows(VI + b * svi_b + h * svi_h, svi_l, offs_i, I, offs_d)
        dkt = tl.zeros((BLOCK_T, D), dtype=tl.float32)
        dvt = tl.zeros((BLOCK_T, D), dtype=tl.float32)
        dki = tl.zeros((BLOCK_I, D), dtype=tl.float32)
        dvi = tl.zeros((BLOCK_I, D), dtype=tl.float32)
        lse = LSE + (pid_bh * 2) * L
        for start in range(pid_s * BLOCK_M, L, SPLIT * BLOCK_M):
            offs_m = start + tl.arange(0, BLOCK_M)
            row = offs_m < L
            q = _load_rows(Q + b * sq_b + h * sq_h, sq_l, offs_m, L, offs_d)
            do = _load_rows(DO + b * sdo_b + h * sdo_h, sdo_l, offs_m, L, offs_d)
            # rows past L: q and dO are zero, so P·dO and dS are zero whatever their log-sum-exp
            lse_t = tl.load(lse + offs_m, mask=row, other=0.0)
            lse_i = tl.load(lse + L + offs_m, mask=row, other=0.0)
            p_t, ds_t = _softmax_grads(q, do, kt, vt, lse_t, offs_t, T, scale, text_bias)
            p_i, ds_i = _softmax_grads(q, do, ki, vi, lse_i, offs_i, I, scale, 0.0)
            ds_t, ds_i = ds_t.to(q.dtype), ds_i.to(q.dtype)
            dq = (tl.dot(ds_t, kt) + tl.dot(ds_i, ki)) * scale
            tl.store(DQ + b * sdq_b + h * sdq_h + offs_m[:, None] * sdq_l + offs_d[None, :],
                     dq.to(DQ.dtype.element_ty), mask=row[:, None])
            dkt += tl.dot(tl.trans(ds_t), q)
            dvt += tl.dot(tl.trans(p_t.to(q.dtype)), do)
            dki += tl.dot(tl.trans(ds_i), q)
            dvi += tl.dot(tl.trans(p_i.to(q.dtype)), do)
        part = pid_s * tl.num_programs(0) + pid_bh
        rows_t = (part * BLOCK_T + offs_t)[:, None] * D + offs_d[None, :]
        rows_i = (part * BLOCK_I + offs_i)[:, None] * D + offs_d[None, :]
        tl.store(DKT + rows_t, dkt * scale)
        tl.store(DVT + rows_t, dvt)
        tl.store(DKI + rows_i, dki * scale)
        tl.store(DVI + rows_i, dvi)


_block = _pow2
# Query rows per program and warps: a tile's scores against up to 128 text keys are [rows, 128] fp32 in registers,
# and the backward also holds the keys' gradient sums, so it takes half the rows
FORWARD_ROWS, FORWARD_WARPS = 64, 8
BACKWARD_ROWS, BACKWARD_WARPS = 32, 8


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _check(q, kt, vt, ki, vi) -> None:
    for name, t in (("q", q), ("kt", kt), ("vt", vt), ("ki", ki), ("vi", vi)):
        if t.dim() != 4 or t.stride(-1) != 1:
            raise ValueError(f"fused cross-attention: {name} must be [B, L, H, D] with unit last stride, "
                             f"got shape {tuple(t.shape)} strides {t.stride()}")
    d = q.shape[-1]
    if d < 16 or d & (d - 1):
        raise ValueError(f"fused cross-attention needs a power-of-two head dim >= 16, got {d}")


def launch_forward(q, kt, vt, ki, vi, pad_count: int, block_m: int = FORWARD_ROWS, launch=None):
    """o [B, L, H, D] (q's dtype) and the log-sum-exps [B·H, 2, L] fp32. `launch` wraps the kernel for
    torch.compile (`wrap_triton`); None launches it directly."""
    _check(q, kt, vt, ki, vi)
    B, L, H, D = q.shape
    T, I = kt.shape[1], ki.shape[1]
    o = torch.empty(B, L, H, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B * H, 2, L, dtype=torch.float32, device=q.device)
    kernel = (launch or (lambda k: k))(_cross_fwd)
    kernel[(triton.cdiv(L, block_m), B * H)](
        q, kt, vt, ki, vi, o, lse, *_strides(q), *_strides(kt), *_strides(vt), *_strides(ki), *_strides(vi),
        *_strides(o), L, T, I, H, 1.0 / math.sqrt(D), math.log(pad_count),
        BLOCK_M=block_m, BLOCK_T=_block(T), BLOCK_I=_block(I), D=D, num_warps=FORWARD_WARPS)
    return o, lse


def backward_split(batch_heads: int, query_tiles: int, programs: int = 1024) -> int:
    """Programs per (sample, head) in the backward: enough programs in all to fill the GPU, at most one per tile."""
    return max(1, min(query_tiles, -(-programs // batch_heads)))


def launch_backward(q, kt, vt, ki, vi, do, lse, pad_count: int, block_m: int = BACKWARD_ROWS, launch=None):
    """dq, dkt, dvt, dki, dvi (shaped as their inputs)."""
    B, L, H, D = q.shape
    T, I = kt.shape[1], ki.shape[1]
    BT, BI = _block(T), _block(I)
    split = backward_split(B * H, triton.cdiv(L, block_m))
    dq = torch.empty(B, L, H, D, dtype=q.dtype, device=q.device)
    part = lambda n: torch.empty(split, B * H, n, D, dtype=torch.float32, device=q.device)  # noqa: E731
    dkt, dvt, dki, dvi = part(BT), part(BT), part(BI), part(BI)
    do = do if do.stride(-1) == 1 else do.contiguous()
    kernel = (launch or (lambda k: k))(_cross_bwd)
    kernel[(B * H, split)](
        q, kt, vt, ki, vi, do, lse, dq, dkt, dvt, dki, dvi,
        *_strides(q), *_strides(kt), *_strides(vt), *_strides(ki), *_strides(vi), *_strides(do), *_strides(dq),
        L, T, I, H, 1.0 / math.sqrt(D), math.log(pad_count), split,
        BLOCK_M=block_m, BLOCK_T=BT, BLOCK_I=BI, D=D, num_warps=BACKWARD_WARPS)

    def total(parts, n, like):  # [split, B·H, BLOCK, D] -> [B, n, H, D] in the input's dtype
        return parts.sum(0)[:, :n].unflatten(0, (B, H)).transpose(1, 2).to(like.dtype).contiguous()
    return dq, total(dkt, T, kt), total(dvt, T, vt), total(dki, I, ki), total(dvi, I, vi)


_op = None


def _build_op():
    """The kernels as one torch.library op with its backward, so that compiled blocks (and their CUDA graphs) keep
    them in their graph."""
    from torch.library import triton_op, wrap_triton

    @triton_op("dzmodel::cross_attention_fwd", mutates_args=())
    def forward(q: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, ki: torch.Tensor, vi: torch.Tensor,
                pad_count: int) -> tuple[torch.Tensor, torch.Tensor]:
        return launch_forward(q, kt, vt, ki, vi, pad_count, launch=wrap_triton)

    @triton_op("dzmodel::cross_attention_bwd", mutates_args=())
    def backward_op(q: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, ki: torch.Tensor, vi: torch.Tensor,
                    do: torch.Tensor, lse: torch.Tensor, pad_count: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return launch_backward(q, kt, vt, ki, vi, do, lse, pad_count, launch=wrap_triton)

    def setup_context(ctx, inputs, output):
        q, kt, vt, ki, vi, pad_count = inputs
        ctx.save_for_backward(q, kt, vt, ki, vi, output[1])
        ctx.pad_count = pad_count

    def backward(ctx, do, _dlse):
        q, kt, vt, ki, vi, lse = ctx.saved_tensors
        return (*backward_op(q, kt, vt, ki, vi, do, lse, ctx.pad_count), None)

    forward.register_autograd(backward, setup_context=setup_context)
    return forward


def cross_attention(q: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, ki: torch.Tensor, vi: torch.Tensor,
                    pad_count: int = 1) -> torch.Tensor:
    """Attn(q, kt, vt) + Attn(q, ki, vi), text row T-1 weighted `pad_count` times; [B, L, H, D] in and out. The
    Triton kernels on CUDA, else `reference_cross_attention`."""
    global _op
    if not (kernels_available(q, kt, vt, ki, vi) and kernel_fits(kt.shape[1], ki.shape[1], q.shape[-1])):
        return reference_cross_attention(q, kt, vt, ki, vi, pad_count)
    if _op is None:
        _op = _build_op()
    return _op(q, kt, vt, ki, vi, pad_count)[0]
