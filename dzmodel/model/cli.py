"""`dz model ...`: the model library's checks; and the solver flags that serving, evaluation and
benchmarks share."""

from __future__ import annotations

import argparse

from ..clitools import EXIT_FAIL, EXIT_OK, CLIError, example


def cmd_model_parity(ns: argparse.Namespace) -> int:
    from ..model.parity import FixtureError, run_parity

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

    from ..model.args import PRESETS, DreamZeroArgs, preset
    from ..model.wam import DreamZeroWAM
    from ..model.wan_dit import WanModel

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
    from ..model.checks import manifest_report

    ok, text = manifest_report()
    print(text)
    return EXIT_OK if ok else EXIT_FAIL


def cmd_model_tokenizer(ns: argparse.Namespace) -> int:
    from ..model.tokenizer import build_tiny_tokenizer, load_tokenizer

    out = build_tiny_tokenizer(ns.out, vocab_size=ns.vocab_size)
    tok = load_tokenizer(out)
    ids, mask = tok(["pick up the red block and place it in the basket"], max_length=16)
    print(f"wrote a {tok.vocab_size}-token tokenizer to {out}")
    print(f"example ids: {ids[0, : int(mask.sum())].tolist()}")
    return EXIT_OK



def add_solver_arguments(p: argparse.ArgumentParser, dit_steps: str = "") -> None:
    p.add_argument("--solver-steps", type=int, default=16, help="Euler steps of the flow solver")
    p.add_argument("--cfg-scale", type=float, default=5.0, help="classifier-free guidance on the video (1 = off)")
    p.add_argument("--dit-steps", default=dit_steps, help="which solver steps run the DiT (T) or reuse its velocity "
                   "(F), e.g. TTTFFFTFFFTFFTTT; 'upstream' = that 16-step schedule (8 DiT forwards); '' = every step"
                   + ("; 'auto' (default) = upstream at 16 solver steps, else every step" if dit_steps == "auto" else
                      " (default)"))


def solver_from(ns: argparse.Namespace):
    from ..model.sampler import SolverConfig

    dit_steps = ns.dit_steps
    if dit_steps == "auto":  # dz serve: upstream's schedule at its 16 steps, every step otherwise
        dit_steps = "upstream" if ns.solver_steps == 16 else ""
    try:
        return SolverConfig(num_steps=ns.solver_steps, cfg_scale=ns.cfg_scale, dit_steps=dit_steps)
    except ValueError as exc:
        raise CLIError(f"--solver-steps/--dit-steps: {exc}") from None


def add_commands(sub) -> None:
    """`dz model ...`."""

    model = sub.add_parser("model", help="model library checks").add_subparsers(dest="cmd", required=True)
    p = model.add_parser("parity", help="reproduce reference fixtures (DiT, VAE or WAM, detected from the file)",
                         epilog=example("dz model parity tests/fixtures/dreamzero_wam_tiny_reference.safetensors"))
    p.add_argument("fixtures", nargs="+", metavar="FIXTURE",
                   help="reference fixture file(s) (.safetensors) to reproduce; exit 1 if any is above --tolerance")
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="largest accepted max absolute error against a fixture's reference outputs")
    p.set_defaults(func=cmd_model_parity)
    p = model.add_parser("info", help="parameter counts of the presets",
                         epilog=example("dz model info", "dz model info --preset dreamzero_5b"))
    p.add_argument("--preset", help="print only this preset (default: every preset)")
    p.set_defaults(func=cmd_model_info)
    p = model.add_parser("tokenizer", help="build the small offline tokenizer of the embedded default",
                         epilog=example("dz model tokenizer build/tokenizer"))
    p.add_argument("out", help="directory to write (tokenizer.json, tokenizer_config.json, special_tokens_map.json)")
    p.add_argument("--vocab-size", type=int, default=640, help="tokens in the vocabulary")
    p.set_defaults(func=cmd_model_tokenizer)
    p = model.add_parser("manifest", help="check module keys/shapes against the WAN checkpoint manifest",
                         epilog=example("dz model manifest"))
    p.set_defaults(func=cmd_model_manifest)
