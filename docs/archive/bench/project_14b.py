"""The full 14B step from `dz bench train` slices of it: a projection, not a measurement.

Two slices of the preset (e.g. 8 and 16 layers, the same configuration otherwise, FSDP2 over the same GPUs) give a
layer's cost (the difference over the layers between them) and the rest of the step (embeddings, head, loss,
optimizer: the shallower slice minus its layers); the full preset's step is the rest plus its layers. MFU is the
full model's FLOPs per sample (`DreamZeroArgs.flops`, as `dz train` counts them) over that step, against the GPU's
dense bf16 peak, also for FP8 rows (an FP8 peak is twice it). One row per configuration (the rows that differ only in
their layers and names, on the same device and number of GPUs):

    python docs/archive/bench/project_14b.py docs/bench/train_14b_fp8_slices_*.jsonl [--layers 40] [--gpus 8]

The GPUs of the slices set the FSDP2 communication each GPU does per block (1/2 of the block's weights gathered and
its gradients reduced on 2 GPUs, 7/8 on 8): where that was hidden behind compute on the slices, it may not be on
more GPUs, so the projection is an upper bound on the rate.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

PEAK_BF16 = (("H200", 989e12), ("H100", 989e12), ("B200", 2250e12), ("A100", 312e12))


def project(rows: list[dict], layers: int | None = None, latent_hw=(44, 80)) -> list[dict]:
    from dzmodel.model.args import preset

    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        gpus = r["name"].split("@fsdp")[1] if "@fsdp" in r["name"] else "1"
        groups[(r["preset"], r["device"], gpus, r["micro_batch"], r.get("accumulation", 1), r["compile"],
                r["activation_checkpointing"], r["attention"], r["encoders"], r.get("lora_rank", 0),
                r.get("precision", "bf16"))].append(r)
    out = []
    for key, slices in groups.items():
        name = "+".join(dict.fromkeys(r["name"] for r in slices))
        latest = {r["num_layers"]: r for r in slices}  # a depth measured twice: its last row
        slices = [latest[n] for n in sorted(latest)]
        if len(slices) < 2:
            print(f"{name}: only {slices[0]['num_layers']}-layer slices: two depths are needed, skipped", file=sys.stderr)
            continue
        shallow, deep = slices[0], slices[-1]
        per_layer = (deep["step_ms"] - shallow["step_ms"]) / (deep["num_layers"] - shallow["num_layers"])
        rest = shallow["step_ms"] - shallow["num_layers"] * per_layer
        args = preset(shallow["preset"])
        full_layers = layers or args.num_layers
        step_ms = rest + full_layers * per_layer
        flops = preset(shallow["preset"], num_layers=full_layers).flops(tuple(latent_hw)).train() * shallow["micro_batch"]
        peak = next((p for key, p in PEAK_BF16 if key in shallow["device"]), None)
        out.append({"name": name, "precision": key[-1], "device": shallow["device"], "gpus": int(key[2]),
                    "slices": [[r["num_layers"], r["step_ms"]] for r in slices], "layer_ms": round(per_layer, 1),
                    "rest_ms": round(rest, 1), "layers": full_layers, "step_ms": round(step_ms, 1),
                    "samples_per_s_per_gpu": round(shallow["micro_batch"] / (step_ms / 1e3), 4),
                    "mfu_vs_bf16_peak": round(flops / (step_ms / 1e3) / peak, 4) if peak else None,
                    "peak_mem_gib_deepest_slice": deep.get("peak_mem_gib")})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl", nargs="+", help="dz bench train --out files of the slices")
    ap.add_argument("--layers", type=int, help="the full model's layers (default: the preset's)")
    ap.add_argument("--latent-hw", default="44,80")
    ns = ap.parse_args()
    rows = [json.loads(line) for path in ns.jsonl for line in Path(path).read_text().splitlines()
            if line.strip() and not line.startswith('{"compare"')]
    for r in project(rows, ns.layers, tuple(int(x) for x in ns.latent_hw.split(","))):
        print(json.dumps(r))


if __name__ == "__main__":
    main()
