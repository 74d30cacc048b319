"""`dz bench ...`: model, data, training, policy and serving benchmarks."""

from __future__ import annotations

import argparse
import os

from ..clitools import EXIT_OK, CLIError, example, latent_hw_arg, row_printer
from ..data.embodiments import DROID_EMBODIMENTS
from ..model.cli import add_solver_arguments, solver_from


def cmd_bench_model(ns: argparse.Namespace) -> int:
    import torch

    from ..bench.model_step import run

    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    hw = latent_hw_arg(ns.latent_hw)
    if ns.check:
        from ..bench.model_step import check_flex_vs_sdpa

        for name, layers, dt, chw in (("tiny", None, torch.float32, "4,6"), (ns.preset, 2, torch.bfloat16, ns.latent_hw)):
            errs = check_flex_vs_sdpa(name, layers, tuple(int(x) for x in chw.split(",")), dt, device)
            print(f"flex vs sdpa, {name} ({dt}): " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    run(ns.preset, ns.layers, [int(b) for b in ns.batch.split(",")], ns.backend.split(","), hw,
        ns.steps, ns.warmup, device, ns.out)
    return EXIT_OK




# The best measured 5B configuration on one H200 (docs/performance.md).
OPTIMISED_VARIANT = {"name": "optimised", "micro_batch": 21, "accumulation": 1, "compile": True, "ac": "elementwise",
                     "attention": "segments", "encoders": "cache"}


def parse_variant(text: str) -> dict:
    """'name=opt,mbs=32,compile=1,ac=full,attn=flex,encoders=cache,lora=64,ema=0.999,prec=fp8' -> run_config
    kwargs."""
    keys = {"name": "name", "mbs": "micro_batch", "accum": "accumulation", "compile": "compile", "ac": "ac",
            "attn": "attention", "encoders": "encoders", "lora": "lora_rank", "ema": "ema_decay", "prec": "precision"}
    out = dict(OPTIMISED_VARIANT)
    for part in text.split(","):
        if "=" not in part:
            raise CLIError(f"variant field {part!r} is not key=value")
        k, v = part.split("=", 1)
        if k not in keys:
            raise CLIError(f"variant key {k!r} is not one of {sorted(keys)}")
        try:
            out[keys[k]] = (int(v) if k in ("mbs", "accum", "lora") else float(v) if k == "ema"
                            else (v in ("1", "true", "yes")) if k == "compile" else v)
        except ValueError:
            raise CLIError(f"variant field {part!r}: {v!r} is not a number") from None
    return out


def cmd_bench_train(ns: argparse.Namespace) -> int:
    from ..bench.train_bench import run

    configs = [parse_variant(v) for v in (ns.variant or ["name=optimised"])]
    if not ns.no_baseline:  # last, so its encoders never share the GPU with an optimised configuration
        configs.append({"name": "baseline", "micro_batch": 1, "compile": False, "ac": "none", "attention": "sdpa",
                        "encoders": "online_per_sample"})
    # Before the first CUDA allocation: large, varying activation sets fragment the default allocator.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    run(ns.preset, ns.layers or None, configs, latent_hw_arg(ns.latent_hw), ns.steps, ns.warmup, ns.out, fsdp=ns.fsdp,
        against_run=ns.against_run)
    return EXIT_OK


def _integers(flag: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise CLIError(f"{flag} takes comma-separated integers, got {text!r}") from None


def cmd_bench_profile(ns: argparse.Namespace) -> int:
    import json

    import torch

    from ..model.fp8 import fp8_unsupported
    from ..bench.train_profile import block_parts, linear_layers, print_linears, print_parts, print_summary, profile_step

    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    hw = latent_hw_arg(ns.latent_hw)
    v = parse_variant(ns.variant)
    result = {}
    if ns.parts or (ns.parts_only and not ns.linears):
        rows = block_parts(ns.preset, hw, v["micro_batch"])
        print(f"one block's pieces alone ({ns.preset}, latent {hw}, micro-batch {v['micro_batch']}):")
        print_parts(rows)
        result["parts"] = rows
    if ns.linears:
        device = "cuda" if torch.cuda.is_available() else "cpu"  # a CPU runs the same matmuls, slowly (smoke tests)
        if device == "cuda" and (why := fp8_unsupported(device)):
            raise CLIError(f"--linears times FP8 layers: {why}")
        rows = linear_layers(ns.preset, hw, v["micro_batch"], device=device, compile=v["compile"])
        print(f"one block's linear layers alone ({ns.preset}, latent {hw}, micro-batch {v['micro_batch']}):")
        print_linears(rows)
        result["linears"] = rows
    if not ns.parts_only:
        s = profile_step(ns.preset, ns.layers or None, v["micro_batch"], v["compile"], v["ac"], v["attention"], hw,
                         ns.trace, fsdp=ns.fsdp, precision=v.get("precision", "bf16"))
        if s is None:  # not rank 0
            return EXIT_OK
        print(f"one training step, {ns.preset} {ns.layers or 'all'} layers, {ns.variant}:")
        print_summary(s)
        result["step"] = {"step_ms": s.step_ms, "compute_busy_ms": s.compute_busy_ms, "exposed_comm_ms": s.exposed_comm_ms, "by_category": s.by_category, "top": s.top}
    if ns.out:
        with open(ns.out, "a") as f:
            f.write(json.dumps({"preset": ns.preset, "layers": ns.layers, "variant": ns.variant, **result}) + "\n")
    return EXIT_OK


def cmd_bench_policy(ns: argparse.Namespace) -> int:
    import torch

    from dataclasses import replace

    from ..bench.policy_bench import PolicySetting, ladder, run_policy_bench

    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    batches = _integers("--batch", ns.batch)
    if ns.ladder:
        settings = ladder()
    else:
        settings = [PolicySetting(name=ns.name, weights=ns.weights or ("bf16" if device.startswith("cuda") else "fp32"),
                                  solver_steps=ns.solver_steps, cfg_scale=ns.cfg_scale, batch_cfg=not ns.no_batch_cfg,
                                  dit_steps=ns.dit_steps, text_cache=not ns.no_text_cache,
                                  cuda_graphs=not ns.no_cuda_graphs, compile=ns.compile)]
    if ns.precision == "fp8":  # the same setting in bf16, then in FP8 on the same model (side by side)
        if ns.ladder:
            raise CLIError("--precision fp8 measures one setting in bf16 and then in FP8: leave out --ladder")
        if ns.weights not in (None, "bf16"):
            raise CLIError("--precision fp8 compares against bf16 weights: leave out --weights or pass bf16")
        settings = [replace(s, weights="bf16") for s in settings]
        settings += [replace(s, name=f"{s.name} fp8", weights="fp8") for s in settings]

    run_policy_bench(ns.preset, device, settings, batches, ns.calls, ns.warmup, ns.breakdown_calls,
                     progress=row_printer(ns.out), gc_freeze=ns.gc_freeze)
    return EXIT_OK


def cmd_bench_data(ns: argparse.Namespace) -> int:
    import json

    from ..bench.data_bench import run_data_bench

    if ns.trainer_loader:
        from ..bench.loader_bench import run_loader_bench

        workers, threads = _integers("--workers", ns.workers), _integers("--decode-threads", ns.decode_threads)
        if min(threads) < 1:
            raise CLIError(f"--decode-threads must be >= 1, got {ns.decode_threads!r}")
        run_loader_bench(ns.workdir, ns.codec, ns.gop, workers, ns.batches, ns.micro_batch, ns.episodes,
                         progress=row_printer(ns.out), video_decode=ns.video_decode, decode_threads=threads,
                         embodiment=ns.embodiment)
        return EXIT_OK
    result = run_data_bench(ns.workdir, workers=_integers("--workers", ns.workers),
                            decode_samples=ns.samples, loader_samples=ns.loader_samples)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return EXIT_OK


def cmd_bench_packing(ns: argparse.Namespace) -> int:
    import json

    from ..bench.packing_bench import run_packing_bench

    try:
        overrides = json.loads(ns.model_overrides) if ns.model_overrides else None
        result = run_packing_bench(ns.preset, ns.embodiments.split(","), ns.samples, ns.capacity, ns.vae_stride,
                                   ns.steps, ns.warmup, ns.device, overrides, packed_attention=ns.attn)
    except (ValueError, NotImplementedError) as e:  # NotImplementedError: FlexAttention's backward off the GPU
        raise CLIError(f"bench packing: {e}") from e
    print(f"{result['samples']} samples of {', '.join(result['embodiments'])} on {result['device']}: packed into "
          f"{result['buffers']} buffers of {result['capacity']} tokens, efficiency {100 * result['packing_efficiency']:.1f} % "
          f"(padding to the largest: {100 * result['padded_efficiency']:.1f} %); forward + backward "
          f"{result['packed_samples_per_s']:.1f} samples/s packed, {result['padded_samples_per_s']:.1f} padded")
    if ns.out:
        with open(ns.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return EXIT_OK


def cmd_bench_serve(ns: argparse.Namespace) -> int:
    import torch

    from .policy_bench import PolicySetting
    from .serve_bench import run_serve_bench

    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if ns.embodiment is None:
        if ns.preset != "tiny":
            raise CLIError(f"dz bench serve --preset {ns.preset}: name the embodiment served with --embodiment (its "
                           "views set the frame that is timed; the default libero_sim_tiny's 64x128 frame suits the "
                           "tiny preset only), e.g. oxe_droid, or one declared in a file given with --embodiments")
        ns.embodiment = "libero_sim_tiny"
    if ns.period_ms < 0:
        raise CLIError(f"--period-ms must be >= 0 (got {ns.period_ms})")
    if ns.clients < 2 or ns.max_batch < 2:
        raise CLIError(f"--clients and --max-batch must be >= 2 (got {ns.clients} and {ns.max_batch}): the "
                       "bench compares several clients with and without batching")
    solver = solver_from(ns)  # as dz serve resolves them ('auto': upstream's schedule at 16 steps)
    setting = PolicySetting(name="serve", weights="bf16" if device.startswith("cuda") else "fp32",
                            solver_steps=solver.num_steps, cfg_scale=solver.cfg_scale, dit_steps=solver.dit_steps,
                            cuda_graphs=not ns.no_cuda_graphs, compile=ns.compile)

    run_serve_bench(ns.preset, ns.embodiment, device, setting, ns.clients, ns.max_batch, ns.batch_window_ms,
                    ns.requests, ns.warmup, embodiment_files=ns.embodiments or [], progress=row_printer(ns.out),
                    period_ms=ns.period_ms)
    return EXIT_OK


def add_commands(sub):
    """`dz bench ...`; returns its subcommands, which other packages extend (`dz bench serve`: dzmodel.serve)."""

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="cmd", required=True)
    p = bench.add_parser("model", help="bf16 forward+backward of the WAM on the DROID token layout",
                         epilog=example("dz bench model --preset dreamzero_5b --layers 4",
                                        "dz bench model --batch 1,2 --backend flex,sdpa --check "
                                        "--out build/model.jsonl"))
    p.add_argument("--preset", default="dreamzero_5b", help="the model preset timed (random weights)")
    p.add_argument("--layers", type=int, default=4, help="cut the preset to this many layers (0 = all)")
    p.add_argument("--batch", default="1", help="comma-separated micro-batch sizes")
    p.add_argument("--backend", default="flex", help="comma-separated: flex, segments, sdpa")
    p.add_argument("--latent-hw", default="11,20", help="latent H,W before patching (5B DROID: 11,20)")
    p.add_argument("--steps", type=int, default=10, help="timed forward+backward steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--device", help="where to run (default: cuda if available, else cpu)")
    p.add_argument("--out", help="append JSON lines here")
    p.add_argument("--check", action="store_true", help="first compare FlexAttention with SDPA (outputs, grads)")
    p.set_defaults(func=cmd_bench_model)
    p = bench.add_parser("train", help="baseline vs optimised training steps, side by side (GPU)",
                         epilog=example("dz bench train",
                                        "dz bench train --layers 4 --no-baseline --variant name=lora,lora=64"))
    p.add_argument("--preset", default="dreamzero_5b", help="the model preset trained (random weights)")
    p.add_argument("--layers", type=int, default=0, help="cut the preset to this many layers (0 = all)")
    p.add_argument("--latent-hw", default="11,20", help="latent H,W (5B DROID 11,20; 14B DROID 44,80)")
    p.add_argument("--variant", action="append",
                   help="an optimised config: name=..,mbs=..,accum=..,compile=0/1,ac=none|elementwise|selective|full|full:N,attn=segments|flex|sdpa,"
                        "encoders=cache|online_batched|online_per_sample,lora=RANK,ema=DECAY,prec=bf16|fp8 (repeatable)")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the unoptimised baseline (micro-batch 1, no compile, encoders per sample)")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 even with one process (its overhead without communication)")
    p.add_argument("--against-run", metavar="RUN_DIR",
                   help="a dz train run at the first variant's settings: compare its logged samples/s/GPU")
    p.add_argument("--steps", type=int, default=8, help="timed training steps per configuration (after --warmup)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--out", help="append JSON lines here")
    p.set_defaults(func=cmd_bench_train)
    p = bench.add_parser("profile", help="where one training step's GPU time goes; --parts: each block piece alone",
                         epilog=example("dz bench profile --layers 2 --trace build/step_trace.json",
                                        "dz bench profile --parts-only --linears"))
    p.add_argument("--preset", default="dreamzero_5b", help="the model preset profiled (random weights)")
    p.add_argument("--layers", type=int, default=2, help="cut the preset to this many layers (0 = all)")
    p.add_argument("--latent-hw", default="11,20", help="latent H,W (5B DROID 11,20; 14B DROID 44,80)")
    p.add_argument("--variant", default="name=optimised", help="one configuration, as in `dz bench train --variant`")
    p.add_argument("--parts", action="store_true", help="also time one block's GEMMs and attention kernels alone")
    p.add_argument("--parts-only", action="store_true",
                   help="no profiled step: only the block's pieces (--parts), or with --linears only its linears")
    p.add_argument("--linears", action="store_true",
                   help="also time each linear layer of a block alone, forward + backward, bf16 against FP8")
    p.add_argument("--trace", help="keep the Chrome trace here")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 even with one process")
    p.add_argument("--out", help="append a JSON line here")
    p.set_defaults(func=cmd_bench_profile)
    p = bench.add_parser("policy", help="latency of one action chunk on the serving path (p50/p95, per-stage breakdown)",
                         epilog=example("dz bench policy --preset dreamzero_5b",
                                        "dz bench policy --preset tiny --device cpu --batch 1,8 --calls 5"))
    p.add_argument("--preset", default="tiny", help="the model preset timed (random weights)")
    p.add_argument("--device", default=None, help="where to run (default: cuda if available, else cpu)")
    p.add_argument("--name", default="custom", help="label of this setting in the JSON")
    p.add_argument("--weights", choices=["bf16", "fp32", "autocast"], default=None,
                   help="bf16 weights (GPU default), fp32 (CPU default), or fp32 under bf16 autocast (the old GPU path)")
    add_solver_arguments(p)
    p.add_argument("--no-batch-cfg", action="store_true",
                   help="run CFG's conditional and unconditional passes one after the other (the old path)")
    p.add_argument("--no-text-cache", action="store_true", help="encode the prompt with umT5 at every call")
    p.add_argument("--no-cuda-graphs", action="store_true", help="launch every kernel from Python (eager)")
    p.add_argument("--compile", action="store_true", help="torch.compile the DiT block (inside the CUDA graphs)")
    p.add_argument("--precision", choices=["bf16", "fp8"], default="bf16",
                   help="fp8: each setting with bf16 weights, then with the DiT blocks' linears in FP8 on the same "
                        "model, with the FP8 chunks' difference from the bf16 ones")
    p.add_argument("--batch", default="1", help="sessions per call, comma-separated (e.g. 1,8,32): chunks/s per batch")
    p.add_argument("--ladder", action="store_true", help="each optimisation in turn, then the fast settings, one model")
    p.add_argument("--calls", type=int, default=10, help="timed calls per setting and batch (after --warmup)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first")
    p.add_argument("--breakdown-calls", type=int, default=3, help="extra calls timed per stage (synchronised)")
    p.add_argument("--gc-freeze", action="store_true",
                   help="freeze Python's heap after the warm-up (gc.freeze, as dz serve does): the collector then "
                        "never rescans the model's objects during a call")
    p.add_argument("--out", help="append one JSON line per measurement here")
    p.set_defaults(func=cmd_bench_policy)
    p = bench.add_parser("data", help="video decode (torchcodec batched vs PyAV) and loader samples/s, DROID-like",
                         epilog=example("dz bench data", "dz bench data --trainer-loader --workers 0,2"))
    p.add_argument("--workdir", default="build/bench_data", help="where the generated source videos are cached")
    p.add_argument("--workers", default="1,2,4", help="DataLoader worker counts to time, comma-separated")
    p.add_argument("--samples", type=int, default=5, help="decode samples to time (median)")
    p.add_argument("--loader-samples", type=int, default=16, help="samples the loader yields per --workers setting")
    p.add_argument("--trainer-loader", action="store_true",
                   help="instead: dz train's own DataLoader (windows, augmentation, layout, collate) at the 5B DROID "
                        "shape on a DROID-shaped dataset (3 cameras at 180x320), samples/s per --workers; one JSON "
                        "line each (appended to --out)")
    p.add_argument("--codec", choices=["h264", "av1"], default="h264", help="with --trainer-loader")
    p.add_argument("--gop", type=int, default=2, help="with --trainer-loader: keyframe interval (LeRobot's is 2)")
    p.add_argument("--batches", type=int, default=30, help="with --trainer-loader: timed micro-batches")
    p.add_argument("--micro-batch", type=int, default=2, help="with --trainer-loader")
    p.add_argument("--episodes", type=int, default=4, help="with --trainer-loader: episodes of 300 frames written")
    p.add_argument("--video-decode", choices=["cpu", "nvdec"], default="cpu",
                   help="with --trainer-loader: where the videos are decoded (train.video_decode); nvdec: on the GPU, "
                        "the workers read only the vectors")
    p.add_argument("--embodiment", choices=DROID_EMBODIMENTS, default=DROID_EMBODIMENTS[0],
                   help="with --trainer-loader: the layout: oxe_droid 352x640 (the 14B's frame), oxe_droid_5b "
                        "176x320 (upstream's 5B frame)")
    p.add_argument("--decode-threads", default="8",
                   help="with --video-decode nvdec: threads decoding files side by side (train.nvdec_threads); "
                        "comma-separated for a row each")
    p.add_argument("--out", help="write the numbers as JSON")
    p.set_defaults(func=cmd_bench_data)
    p = bench.add_parser("packing", help="a mixture of embodiments packed into buffers vs padded to the largest",
                         epilog=example("dz bench packing",
                                        "dz bench packing --embodiments libero_sim_small,oxe_droid --samples 8 "
                                        "--attn flex"))
    p.add_argument("--preset", default="small", help="the model preset (random weights)")
    p.add_argument("--model-overrides", default='{"patch_size": [1, 1, 1]}',
                   help="JSON preset overrides (default: the libero_object profile's 1x1 patches)")
    p.add_argument("--embodiments", default="libero_sim_small,oxe_droid,g1=128x128",
                   help="comma-separated embodiment tags or NAME=HxW frame sizes (g1=128x128: one head camera)")
    p.add_argument("--samples", type=int, default=12, help="samples, the embodiments taking turns")
    p.add_argument("--capacity", type=int, default=0, help="tokens per buffer (0: longest sample x embodiments)")
    p.add_argument("--attn", choices=["segments", "flex"], default="segments",
                   help="the packed side's attention: a call per mask rectangle, or one FlexAttention call per layer")
    p.add_argument("--vae-stride", type=int, default=16,
                   help="pixels per latent (16: the small preset's and Wan2.2's VAE; 8: Wan2.1's, the 14B)")
    p.add_argument("--steps", type=int, default=3, help="timed forward+backward steps each way (after --warmup)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--device", help="where to run (default: cuda if available, else cpu)")
    p.add_argument("--out", help="append a JSON line here")
    p.set_defaults(func=cmd_bench_packing)

    # the server under load, through its real clients (bench sits above serve)
    p = bench.add_parser("serve", help="dz serve with N concurrent clients (openpi's client): chunks/s and each "
                         "client's p95, batching off and on, on a preset's model with random weights",
                         epilog=example("dz bench serve --clients 4 --requests 10",
                                        "dz bench serve --preset dreamzero_5b --embodiment oxe_droid --clients 8 "
                                        "--compile"))
    p.add_argument("--preset", default="tiny", help="the model preset served (random weights)")
    p.add_argument("--embodiment", default=None,
                   help="the protocol, views and widths served (default libero_sim_tiny, for the tiny preset only; "
                        "e.g. oxe_droid for a large preset on DROID)")
    p.add_argument("--embodiments", action="append", help="extra embodiment YAML file(s)")
    p.add_argument("--device", default=None, help="where the server's policy runs (default: cuda if available, "
                                                   "else cpu)")
    add_solver_arguments(p, dit_steps="auto")
    p.add_argument("--no-cuda-graphs", action="store_true", help="launch every kernel from Python (eager)")
    p.add_argument("--compile", action="store_true", help="torch.compile the DiT block (inside the CUDA graphs)")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients, each one session")
    p.add_argument("--max-batch", type=int, default=8, help="the batched row's dz serve --max-batch")
    p.add_argument("--batch-window-ms", type=float, default=5.0,
                   help="the batched row's dz serve --batch-window-ms: how long a request waits for others to join")
    p.add_argument("--requests", type=int, default=20, help="timed requests per client (after --warmup)")
    p.add_argument("--warmup", type=int, default=3, help="untimed requests per client first")
    p.add_argument("--period-ms", type=float, default=0.0,
                   help="each of the N clients asks for a chunk every this many ms, as a robot that plays each chunk "
                        "that long (phases spread evenly); 0: ask again as soon as answered (the full load)")
    p.add_argument("--out", help="append one JSON line per row here")
    p.set_defaults(func=cmd_bench_serve)
    return bench
