"""`dz bench packing`: the counts it reports follow from the layouts, and it times both sides."""

import json

import pytest

from dzmodel.cli import main
from dzmodel.model.args import preset
from dzmodel.model.attention import latent_layout
from dzmodel.bench.packing_bench import embodiment_latent_hw, run_packing_bench


def test_frame_sizes_come_from_the_embodiments_layout_or_are_given():
    args = preset("tiny")
    assert embodiment_latent_hw(args, "libero_sim_small", 8) == (16, 32)  # two 128 px views side by side
    assert embodiment_latent_hw(args, "g1=64x96", 8) == (8, 12)
    with pytest.raises(ValueError, match="unknown embodiment 'nope'"):
        embodiment_latent_hw(args, "nope", 8)
    with pytest.raises(ValueError, match="a frame size is NAME=HxW"):
        embodiment_latent_hw(args, "g1=big", 8)


def test_the_bench_counts_tokens_as_the_layouts_do_and_times_both_sides(tmp_path):
    result = run_packing_bench("tiny", ("libero_sim_small", "oxe_droid", "g1=128x128"), samples=6, capacity=0,
                               vae_stride=32, steps=1, warmup=0, device="cpu")
    args = preset("tiny")
    tokens = {t: latent_layout(args, embodiment_latent_hw(args, t, 32)).seq_len
              for t in ("libero_sim_small", "oxe_droid", "g1=128x128")}
    assert {t: e["tokens"] for t, e in result["embodiments"].items()} == tokens
    lengths = [tokens[t] for t in ("libero_sim_small", "oxe_droid", "g1=128x128")] * 2
    assert result["capacity"] == 3 * max(lengths)
    assert result["packing_efficiency"] == pytest.approx(sum(lengths) / (result["capacity"] * result["buffers"]))
    assert result["padded_efficiency"] == pytest.approx(sum(lengths) / (6 * max(lengths)))
    assert result["packing_efficiency"] > result["padded_efficiency"]
    assert result["packed_samples_per_s"] > 0 and result["padded_samples_per_s"] > 0
    out = tmp_path / "packing.jsonl"
    assert main(["bench", "packing", "--preset", "tiny", "--model-overrides", "", "--samples", "3", "--steps", "1",
                 "--warmup", "0", "--vae-stride", "32", "--device", "cpu", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["samples"] == 3
