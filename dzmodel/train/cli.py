"""`dz train`, `dz cache` and `dz convert`."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..clitools import EXIT_OK, CLIError, example, latent_hw_arg


def load_train_config(ns: argparse.Namespace):
    import json

    from ..train.config import TrainConfig

    raw: dict = {}
    if ns.config:
        path = Path(ns.config)
        if not path.is_file():
            raise CLIError(f"config file not found: {path}")
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            from ..schema import load_yaml

            try:
                raw = load_yaml(text) or {}
            except yaml.YAMLError as exc:
                raise CLIError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
        else:
            raw = json.loads(text)
        if not isinstance(raw, dict):
            raise CLIError(f"{path}: expected a mapping of train config fields")
    for item in ns.set or []:
        if "=" not in item:
            raise CLIError(f"--set wants key=value, got {item!r}")
        key, value = item.split("=", 1)
        try:
            raw[key] = json.loads(value)
        except json.JSONDecodeError:
            raw[key] = value
    for key in ("preset", "embodiment", "metadata", "steps", "out_dir", "skip_missing"):
        value = getattr(ns, key, None)
        if value is not None:
            raw[key] = value
    if ns.dataset:
        raw["datasets"] = ns.dataset
    if getattr(ns, "embodiments", None):
        raw["embodiment_files"] = list(raw.get("embodiment_files") or []) + ns.embodiments
    try:
        return TrainConfig.from_dict(raw)
    except (TypeError, ValueError) as exc:
        raise CLIError(str(exc)) from exc


def cmd_train(ns: argparse.Namespace) -> int:
    from ..train.launch import run

    run(load_train_config(ns), overwrite=ns.overwrite)
    return EXIT_OK



def cmd_cache(ns: argparse.Namespace) -> int:
    from ..train.cache import build_cache, synthetic_cache

    cfg = load_train_config(ns)
    if ns.prompt_tokens is not None and ns.synthetic is None:
        raise CLIError("--prompt-tokens shapes a synthetic cache's prompts: it goes with --synthetic N")
    if ns.synthetic is not None:
        if ns.synthetic < 1:
            raise CLIError(f"--synthetic wants a number of samples >= 1, got {ns.synthetic}")
        out = synthetic_cache(cfg.preset, ns.cache_out, ns.synthetic, latent_hw_arg(ns.latent_hw),
                              seed=cfg.seed, model_overrides=cfg.model_overrides, overwrite=ns.overwrite,
                              learnable=ns.learnable, prompt_tokens=ns.prompt_tokens)
        kind = "random samples whose actions follow from frame 0 and the state" if ns.learnable else "random samples"
        if ns.prompt_tokens:
            kind += f", prompts of up to {ns.prompt_tokens} tokens"
        print(f"wrote a synthetic cache of {ns.synthetic} {cfg.preset} {kind} (seed {cfg.seed}): {out}")
        return EXIT_OK
    if not cfg.tokenizer:
        raise CLIError("dz cache needs the tokenizer directory (train.tokenizer / --set tokenizer=DIR)")
    out = build_cache(cfg, ns.cache_out, stride=ns.stride, batch_size=ns.batch_size, overwrite=ns.overwrite)
    print(f"wrote the encoder cache {out}")
    return EXIT_OK


def cmd_convert(ns: argparse.Namespace) -> int:
    from ..train.convert import convert_checkpoint, resolve_checkpoint

    ckpt = resolve_checkpoint(ns.checkpoint, ns.step)
    out = convert_checkpoint(ckpt, ns.out, max_shard_bytes=int(ns.max_shard_gib * 2**30),
                             adapters_only=ns.adapters_only, weights=ns.weights, overwrite=ns.overwrite)
    print(f"converted {ckpt} -> {out}")
    return EXIT_OK


def add_commands(sub) -> None:
    """`dz train`, `dz cache` and `dz convert`."""

    p = sub.add_parser("train", help="SFT training (one process, or under torchrun with FSDP2)",
                       epilog=example("dz train --dataset build/synth --metadata build/metadata.json --steps 20 "
                                      "--out runs/try",
                                      "dz train --config cfg.yaml --set lr=2e-4 --set micro_batch=4"))
    p.add_argument("--config", help="YAML/JSON file of train settings (dzmodel.train.config.TrainConfig fields)")
    p.add_argument("--set", action="append", help="override one field: key=value (value parsed as JSON when it can be)")
    p.add_argument("--preset", help="the model preset, e.g. tiny, small, dreamzero_5b (train config's preset)")
    p.add_argument("--dataset", action="append", help="LeRobot dataset directory (repeatable: a mixture)")
    p.add_argument("--embodiment", help="the embodiment tag the data is read as (train config's embodiment)")
    p.add_argument("--metadata", help="metadata.json with the embodiment's statistics (dz data metadata)")
    p.add_argument("--steps", type=int, help="optimizer steps to train (train config's steps)")
    p.add_argument("--out", dest="out_dir",
                   help="the run directory: checkpoints and logs; an earlier run there is resumed (train config's "
                        "out_dir)")
    p.add_argument("--skip-missing", action="store_true", default=None,
                   help="train on the other episodes when some view videos are missing (they are listed)")
    p.add_argument("--embodiments", action="append", help="extra embodiment YAML file(s), as the data commands take")
    p.add_argument("--overwrite", action="store_true",
                   help="train into an out_dir that dz did not write (by default refused unless empty)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("cache", help="precompute frozen-encoder outputs (VAE, umT5, CLIP) per sample window",
                       epilog=example("dz cache --config cfg.yaml --out data/cache",
                                      "dz cache --preset tiny --synthetic 64 --latent-hw 4,6 --out build/synth_cache"))
    p.add_argument("--config", help="the train config (datasets, embodiment, metadata, tokenizer, preset)")
    p.add_argument("--set", action="append", help="override one train config field: key=value (value parsed as JSON "
                                                   "when it can be)")
    p.add_argument("--preset", help="the model preset whose encoders (or, with --synthetic, shapes) are used")
    p.add_argument("--dataset", action="append", help="LeRobot dataset directory (repeatable: a mixture)")
    p.add_argument("--embodiment", help="the embodiment tag the data is read as")
    p.add_argument("--metadata", help="metadata.json with the embodiment's statistics (dz data metadata)")
    p.add_argument("--embodiments", action="append", help="extra embodiment YAML file(s)")
    p.add_argument("--out", dest="cache_out", required=True, help="cache directory to write")
    p.add_argument("--stride", type=int, default=1, help="cache every stride-th anchor")
    p.add_argument("--batch-size", type=int, default=8, help="sample windows encoded together")
    p.add_argument("--synthetic", type=int, metavar="N",
                   help="no data or encoders: N random samples of the preset's real shapes (to measure dz train)")
    p.add_argument("--latent-hw", default="11,20", help="with --synthetic: latent H,W (5B DROID 11,20)")
    p.add_argument("--learnable", action="store_true",
                   help="with --synthetic: actions a fixed function of frame 0 and the state (the same for every "
                        "seed), so a cache of another seed (--set seed=N) is held-out data (train.val_cache)")
    p.add_argument("--prompt-tokens", type=int, metavar="T",
                   help="with --synthetic: each prompt's embedding zero past its own length, the longest T rows "
                        "(as umT5 pads a prompt); by default every row of text_len is random")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out even if dz did not write it (by default only an earlier dz output is replaced)")
    p.set_defaults(func=cmd_cache, steps=None, out_dir=None)

    p = sub.add_parser("convert", help="DCP checkpoint -> HF-style directory (config.json + safetensors)",
                       epilog=example("dz convert runs/x --out runs/x/hf",
                                      "dz convert runs/x --step 1000 --weights ema --out runs/x/hf_1000"))
    p.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its newest checkpoint)")
    p.add_argument("--out", required=True, help="the model directory to write")
    p.add_argument("--step", type=int, help="with a run directory: that step's checkpoint")
    p.add_argument("--max-shard-gib", type=float, default=5.0, help="largest safetensors file written, in GiB")
    p.add_argument("--adapters-only", action="store_true",
                   help="a LoRA run: write only the trainable tensors (adapters.safetensors), not merged weights")
    p.add_argument("--weights", choices=("raw", "ema"), default="raw",
                   help="the optimizer's weights, or the EMA a run with train.ema_decay kept")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out even if dz did not write it (by default only an earlier dz output is replaced)")
    p.set_defaults(func=cmd_convert)
