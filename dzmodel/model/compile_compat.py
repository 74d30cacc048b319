"""Work-arounds for torch.compile bugs of the torch versions the project runs on (one function per bug).

`allow_bare_cantsplit`: torch 2.11's Inductor (the GPU image's) raises `CantSplit` in one branch of
`SIMDKernel._split_iteration_ranges` without the two arguments `CantSplit.__init__` requires (pytorch/pytorch#178676,
fixed by #178886). The `TypeError` that results escapes the `except CantSplit` with which `is_compatible` rejects a
tiling candidate, and the whole compile fails:

    InductorError: TypeError: CantSplit.__init__() missing 2 required positional arguments: 'expr' and 'remaining'

It hits the small preset's compiled blocks with the `segments` attention backend (the GPU default), at either patch
size (`sdpa` compiles). Giving the two arguments defaults restores what the
code means: the candidate tiling is rejected and Inductor picks another.

`single_tile_dimension`: with that, the blocks compile and matched eager ones at micro-batch 8, but at micro-batch
128 their backward computed wrong gradients (gradient norm 1,357 against eager's 4.3 at the first
step on an H200, the forward's loss equal). Both come from Inductor's multi-dimensional tiling of the pointwise and
reduction kernels: limited to one tiled dimension (`triton.max_tiles = 1`), the compiled gradients match eager
ones (4.347, 1.249, 1.903, 2.061 against eager's 4.347, 1.249, 1.903, 2.062 over four steps). `dz train` still checks
compiled against eager before it trains (`Trainer._check_compiled`), whatever the torch version.
"""

from __future__ import annotations


def allow_bare_cantsplit() -> bool:
    """Let Inductor's `CantSplit` be raised without arguments (see the module docstring). Returns True when it
    patched, False when nothing needed patching (a fixed torch, no Triton/Inductor SIMD codegen) or was patched."""
    try:
        from torch._inductor.codegen import simd
    except Exception:  # pragma: no cover - a torch without Inductor
        return False
    cls = getattr(simd, "CantSplit", None)
    if cls is None or getattr(cls, "_dz_bare_ok", False):
        return False
    try:
        cls()
        return False  # already constructible without arguments
    except TypeError:
        pass
    original = cls.__init__

    def __init__(self, expr=None, remaining=None, *args, **kwargs):
        original(self, expr, remaining, *args, **kwargs)

    cls.__init__ = __init__
    cls._dz_bare_ok = True
    return True


def single_tile_dimension() -> None:
    """Inductor tiles each generated kernel along one dimension only (see the module docstring). Process-wide: it
    applies to every compile after it, which in training are only the model's blocks."""
    try:
        import torch._inductor.config as inductor
    except Exception:  # pragma: no cover - a torch without Inductor
        return
    inductor.triton.max_tiles = 1
