"""Reproduce the Inductor `CantSplit` failure of `train.compile: true` on the small preset, and check the fix.

    python3 docs/archive/results/compile_small_repro.py                 # every variant, each in a fresh process
    python3 docs/archive/results/compile_small_repro.py --only p111_segments_mb32,p111_sdpa_mb32 --without-fix
    python3 docs/archive/results/compile_small_repro.py --variant p111_segments_mb32   # one variant, in this process
    python3 docs/archive/results/compile_small_repro.py --only p111_segments_mb128,p111_sdpa_mb128 --steps 10
                                                  # the shape that diverged: do compiled and eager track each other?
    python3 docs/archive/results/compile_small_repro.py --only p111_segments_mb128 --steps 4 --inductor triton.max_tiles=1
                                                  # the same under an Inductor setting (torch._inductor.config)

Found (H100, torch 2.11): without the fix (`--without-fix`) the `segments` variants fail with
    InductorError: TypeError: CantSplit.__init__() missing 2 required positional arguments: 'expr' and 'remaining'
raised by a bare `raise CantSplit` in torch/_inductor/codegen/simd.py `_split_iteration_ranges` (pytorch#178676),
while `sdpa` compiles; with it (dzmodel/model/compile_compat.py, applied by `apply_recompute_and_compile`) every
variant compiles.

Each variant builds the trainer's own TrainStep (dz train's model, compiled blocks, bf16 autocast, AdamW) at the
libero_scripted shape (2 views of 128 px side by side -> a latent of 8 x 16 per frame, 1 + 2 x 2 latent frames,
16-action chunks) and runs two training steps on synthetic encoded batches, eager then compiled, and compares the
losses. It prints one line per variant: ok (with the loss difference) or the exception's last lines. No data,
no encoders (the encoders are not compiled), so it needs torch alone; on a CPU Inductor generates C++, not Triton,
so the Triton-only CantSplit cannot occur there.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

VARIANTS = {
    # name: (patch_size, attn_backend, micro_batch, activation_checkpointing)
    "p111_segments_mb32": ((1, 1, 1), "segments", 32, "none"),      # libero_scripted as configured
    "p111_segments_mb2": ((1, 1, 1), "segments", 2, "none"),
    "p122_segments_mb32": ((1, 2, 2), "segments", 32, "none"),      # the preset's own patches
    "p111_flex_mb32": ((1, 1, 1), "flex", 32, "none"),
    "p111_sdpa_mb32": ((1, 1, 1), "sdpa", 32, "none"),
    "p111_segments_mb32_ew": ((1, 1, 1), "segments", 32, "elementwise"),
    # micro-batch 128: the shape at which compiled training diverged in `dz train` (docs/results.md, round 6)
    "p111_segments_mb128": ((1, 1, 1), "segments", 128, "none"),
    "p111_sdpa_mb128": ((1, 1, 1), "sdpa", 128, "none"),
    "p111_flex_mb128": ((1, 1, 1), "flex", 128, "none"),
}


def set_inductor(settings: list[str]) -> None:
    """`key=value` pairs onto torch._inductor.config (dotted keys: triton.max_tiles=1); values parsed as Python."""
    import ast

    import torch._inductor.config as config

    for item in settings:
        key, value = item.split("=", 1)
        *path, leaf = key.split(".")
        target = config
        for part in path:
            target = getattr(target, part)
        setattr(target, leaf, ast.literal_eval(value))
        print(f"  inductor {key} = {getattr(target, leaf)!r}", flush=True)


def run_variant(name: str, without_fix: bool = False, steps: int = 2, inductor: list[str] = ()) -> None:
    import torch

    set_inductor(list(inductor))

    if without_fix:  # torch's own behaviour: the bare `raise CantSplit` stays a TypeError
        import dzmodel.model.compile_compat as compat

        compat.allow_bare_cantsplit = lambda: False

    from dzmodel.train.synthetic import synthetic_batches
    from dzmodel.train.config import TrainConfig
    from dzmodel.train.trainer import Trainer

    patch, attn, mb, ac = VARIANTS[name]
    losses = {}
    for compile in (False, True):
        cfg = TrainConfig(preset="small", model_overrides={"patch_size": list(patch)}, micro_batch=mb,
                          global_batch=mb, compile=compile, activation_checkpointing=ac, attn_backend=attn,
                          precision="bf16", lr=1e-4, warmup_ratio=0.0, out_dir="/tmp/compile_repro",
                          progress=False, save_every=0)
        trainer = Trainer(cfg)
        trainer.build_model(with_encoders=False)
        batches = synthetic_batches(trainer.args, mb, (8, 16), trainer.info.device, "cache")
        t0 = time.perf_counter()
        reads = [trainer.step(batches, 1e-4).read() for _ in range(steps)]
        losses[compile] = [r[0][0] for r in reads]
        print(f"  {name} compile={compile}: losses {[round(x, 5) for x in losses[compile]]}, gradient norms "
              f"{[round(r[1], 3) for r in reads]} ({time.perf_counter() - t0:.1f} s)", flush=True)
    first, second = (abs(a - b) for a, b in zip(losses[True][:2], losses[False][:2]))
    # step 1 compares the forward (same weights, same noise); step 2 follows one AdamW step, whose first update is
    # +-lr per element, so bf16 rounding flips the elements whose gradient is below it: expect ~0.1 there in bf16
    print(f"RESULT {name}: ok, |compiled - eager| loss: step 1 {first:.2e}, step 2 {second:.2e}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--variant", choices=sorted(VARIANTS))
    p.add_argument("--only", help="comma-separated variants to run (default: all)")
    p.add_argument("--timeout", type=int, default=400)
    p.add_argument("--without-fix", action="store_true", help="leave torch's CantSplit as it is (shows the failure)")
    p.add_argument("--steps", type=int, default=2, help="training steps per arm (each prints its losses and "
                   "gradient norms: compiled and eager should track each other)")
    p.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                   help="a torch._inductor.config setting for the compiled arm's process (repeatable)")
    ns = p.parse_args()
    if ns.variant:
        try:
            run_variant(ns.variant, ns.without_fix, ns.steps, ns.inductor)
        except Exception as exc:  # the point: show where Inductor fails
            tb = traceback.format_exc().splitlines()
            print("\n".join(tb[-60:]))
            print(f"RESULT {ns.variant}: FAILED {type(exc).__name__}: {str(exc)[:400]}", flush=True)
            return 1
        return 0
    for name in (ns.only.split(",") if ns.only else VARIANTS):
        try:
            extra = (["--without-fix"] if ns.without_fix else []) + ["--steps", str(ns.steps)]
            extra += [a for setting in ns.inductor for a in ("--inductor", setting)]
            proc = subprocess.run([sys.executable, __file__, "--variant", name, *extra], capture_output=True, text=True,
                                  timeout=ns.timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            out = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            out += f"\nRESULT {name}: TIMEOUT after {ns.timeout} s"
        Path(os.environ.get("OUT", "/tmp"), f"compile_{name}.log").write_text(out)
        print(next((line for line in out.splitlines()[::-1] if line.startswith("RESULT")), f"RESULT {name}: ?"),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
