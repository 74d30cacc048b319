"""The `dz` command line: one code path for people, Prefect tasks and dvc.yaml.

    dz model parity FIXTURE [FIXTURE ...]   reproduce reference fixtures (exit 1 above tolerance)
    dz model info [--preset NAME]           parameter counts of the presets
    dz model manifest                       check our modules against the WAN checkpoint manifest
    dz model tokenizer OUT                  build the small offline tokenizer of the embedded default
    dz bench model ...                      bf16 forward+backward timing on a GPU
"""

from __future__ import annotations

import argparse
import sys

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class CLIError(Exception):
    """A user error: printed as one line, exit code 2."""


# --- dz model --------------------------------------------------------------------

def cmd_model_parity(ns: argparse.Namespace) -> int:
    from .model.parity import FixtureError, run_parity

    failed = False
    for path in ns.fixtures:
        try:
            result = run_parity(path, tolerance=ns.tolerance)
        except FixtureError as exc:
            raise CLIError(str(exc)) from exc
        print(result.report())
        failed |= not result.ok
    return EXIT_FAIL if failed else EXIT_OK


def cmd_model_info(ns: argparse.Namespace) -> int:
    import torch

    from .model.args import PRESETS, DreamZeroArgs, preset
    from .model.wam import DreamZeroWAM
    from .model.wan_dit import WanModel

    names = [ns.preset] if ns.preset else list(PRESETS)
    print(f"{'preset':<16} {'params':>16} {'dim':>6} {'layers':>6} {'heads':>5} {'ffn':>6}")
    for name in names:
        try:
            args = preset(name)
        except KeyError as exc:
            raise CLIError(str(exc.args[0])) from exc
        with torch.device("meta"):
            model = DreamZeroWAM(args) if isinstance(args, DreamZeroArgs) else WanModel(args)
        n = sum(p.numel() for p in model.parameters())
        print(f"{name:<16} {n:>16,} {args.dim:>6} {args.num_layers:>6} {args.num_heads:>5} {args.ffn_dim:>6}")
    return EXIT_OK


def cmd_model_manifest(ns: argparse.Namespace) -> int:
    from .model.checks import manifest_report

    ok, text = manifest_report()
    print(text)
    return EXIT_OK if ok else EXIT_FAIL


def cmd_model_tokenizer(ns: argparse.Namespace) -> int:
    from .model.tokenizer import build_tiny_tokenizer, load_tokenizer

    out = build_tiny_tokenizer(ns.out, vocab_size=ns.vocab_size)
    tok = load_tokenizer(out)
    ids, mask = tok(["pick up the red block and place it in the basket"], max_length=16)
    print(f"wrote a {tok.vocab_size}-token tokenizer to {out}")
    print(f"example ids: {ids[0, : int(mask.sum())].tolist()}")
    return EXIT_OK


# --- dz bench ----------------------------------------------------------------------

def cmd_bench_model(ns: argparse.Namespace) -> int:
    import torch

    from .bench.model_step import run

    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    hw = tuple(int(x) for x in ns.latent_hw.split(","))
    if len(hw) != 2:
        raise CLIError(f"--latent-hw must be H,W (e.g. 11,20), got {ns.latent_hw!r}")
    if ns.check:
        from .bench.model_step import check_flex_vs_sdpa

        for name, layers, dt, chw in (("tiny", None, torch.float32, "4,6"), (ns.preset, 2, torch.bfloat16, ns.latent_hw)):
            errs = check_flex_vs_sdpa(name, layers, tuple(int(x) for x in chw.split(",")), dt, device)
            print(f"flex vs sdpa, {name} ({dt}): " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    run(ns.preset, ns.layers, [int(b) for b in ns.batch.split(",")], ns.backend.split(","), hw,
        ns.steps, ns.warmup, device, ns.out)
    return EXIT_OK


# --- parser ----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dz", description="DreamZero fine-tuning pipeline")
    sub = parser.add_subparsers(dest="group", required=True)

    model = sub.add_parser("model", help="model library checks").add_subparsers(dest="cmd", required=True)
    p = model.add_parser("parity", help="reproduce reference fixtures (DiT, VAE or WAM, detected from the file)")
    p.add_argument("fixtures", nargs="+", metavar="FIXTURE")
    p.add_argument("--tolerance", type=float, default=1e-4)
    p.set_defaults(func=cmd_model_parity)
    p = model.add_parser("info", help="parameter counts of the presets")
    p.add_argument("--preset")
    p.set_defaults(func=cmd_model_info)
    p = model.add_parser("tokenizer", help="build the small offline tokenizer of the embedded default")
    p.add_argument("out", help="directory to write (tokenizer.json, tokenizer_config.json, special_tokens_map.json)")
    p.add_argument("--vocab-size", type=int, default=640)
    p.set_defaults(func=cmd_model_tokenizer)
    p = model.add_parser("manifest", help="check module keys/shapes against the WAN checkpoint manifest")
    p.set_defaults(func=cmd_model_manifest)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="cmd", required=True)
    p = bench.add_parser("model", help="bf16 forward+backward of the WAM on the DROID token layout")
    p.add_argument("--preset", default="dreamzero_5b")
    p.add_argument("--layers", type=int, default=4, help="cut the preset to this many layers (0 = all)")
    p.add_argument("--batch", default="1", help="comma-separated micro-batch sizes")
    p.add_argument("--backend", default="flex", help="comma-separated: flex, sdpa")
    p.add_argument("--latent-hw", default="11,20", help="latent H,W before patching (5B DROID: 11,20)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device")
    p.add_argument("--out", help="append JSON lines here")
    p.add_argument("--check", action="store_true", help="first compare FlexAttention with SDPA (outputs, grads)")
    p.set_defaults(func=cmd_bench_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except CLIError as exc:
        print(f"dz: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
