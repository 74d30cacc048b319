"""The transposed, zero-padded copy of a one-byte matrix, as an op the compiler keeps whole.

The FP8 weight gradient dW = dY^T X takes both operands with the token dimension inner and padded to a multiple of
16 (`torch._scaled_mm`'s layout), and the input gradient dX = dY W takes W column-major. Left to Inductor, each
transpose fused into the cast that produced the FP8 tensor, and the fused kernels ran at about a twentieth of the
memory bandwidth: a 5B training step spent more time in dW's than in its FP8 matmuls. As a custom op, the copy
is its own kernel on the GPU (Triton, square tiles: both the reads and the writes are contiguous rows) and a plain
strided copy elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ALIGN = 16  # _scaled_mm wants every matmul dimension a multiple of 16
TILE = 64


def padded_rows(rows: int) -> int:
    return (rows + ALIGN - 1) // ALIGN * ALIGN


def _torch_transpose_padded(t: torch.Tensor) -> torch.Tensor:
    extra = padded_rows(t.shape[0]) - t.shape[0]
    # a new tensor even where t.t() is already contiguous: a custom op's output must not alias its input
    return (F.pad(t, (0, 0, 0, extra)) if extra else t).t().clone(memory_format=torch.contiguous_format)


try:  # Triton comes with CUDA builds of torch; CPU builds run the plain copy
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the torch build
    triton = None
else:
    @triton.jit
    def _transpose_padded_kernel(src, dst, rows, cols, padded, TILE: tl.constexpr):
        r = tl.program_id(0) * TILE + tl.arange(0, TILE)
        c = tl.program_id(1) * TILE + tl.arange(0, TILE)
        # rows past the end read as 0: they are the padding
        tile = tl.load(src + r[:, None].to(tl.int64) * cols + c[None, :],
                       mask=(r[:, None] < rows) & (c[None, :] < cols), other=0)
        tl.store(dst + c[:, None].to(tl.int64) * padded + r[None, :], tl.trans(tile),
                 mask=(c[:, None] < cols) & (r[None, :] < padded))


def uses_triton(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


def _check(t: torch.Tensor) -> None:
    if t.dim() != 2 or t.element_size() != 1:
        raise ValueError(f"transpose_padded takes a 2-d tensor of one-byte elements, got {tuple(t.shape)} {t.dtype}")


@torch.library.custom_op("dzmodel::transpose_padded", mutates_args=())
def transpose_padded(t: torch.Tensor) -> torch.Tensor:
    """t [M, N] of one-byte elements (an FP8 tensor viewed as uint8) as a contiguous [N, M'], M' = M rounded up to
    a multiple of 16, the extra columns zero (they add nothing to a product over M)."""
    _check(t)
    if not uses_triton(t) or t.numel() == 0:
        return _torch_transpose_padded(t)
    rows, cols = t.shape
    t = t.contiguous()
    out = torch.empty(cols, padded_rows(rows), dtype=t.dtype, device=t.device)
    grid = (triton.cdiv(out.shape[1], TILE), triton.cdiv(cols, TILE))
    with torch.cuda.device(t.device):  # Triton launches on the current device
        _transpose_padded_kernel[grid](t, out, rows, cols, out.shape[1], TILE=TILE)
    return out


@transpose_padded.register_fake
def _(t: torch.Tensor) -> torch.Tensor:
    _check(t)
    return t.new_empty(t.shape[1], padded_rows(t.shape[0]))
