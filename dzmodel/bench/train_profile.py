"""Where a training step's GPU time goes: `python -m dzmodel.bench.train_profile [layers] [mbs] [compile]`."""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from ..model.args import preset
from ..model.flops import droid_layout
from ..model.objective import FlowMatchSchedule, flow_matching_losses, sample_timestep_ids
from ..model.wam import DreamZeroWAM
from ..train.parallelize import apply_activation_checkpointing, apply_compile
from .model_step import random_inputs


def main(layers: int = 4, mbs: int = 32, compile: bool = True, ac: str = "full") -> None:
    args = preset("dreamzero_5b", num_layers=layers)
    with torch.device("cuda"):
        model = DreamZeroWAM(args)
    if compile:  # compile first: the checkpoint wraps the compiled forward
        apply_compile(model)
    apply_activation_checkpointing(model, ac)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = random_inputs(model, mbs, (11, 20), "cuda", torch.float32, gen)
    mask = model.make_mask(droid_layout(args, (11, 20)), "flex", torch.device("cuda"))
    sched = FlowMatchSchedule()
    actions = torch.rand(mbs, 96, args.action_dim, device="cuda") * 2 - 1

    def step():
        clean = inputs["clean_latents"]
        _, tid, aid = sample_timestep_ids(mbs, args.num_frames, 2, 24)
        tid, aid = tid.cuda(), aid.cuda()
        noise, na = torch.randn_like(clean), torch.randn_like(actions)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(sched.add_noise(clean, noise, tid, 2), clean, sched.timestep(tid),
                        sched.add_noise(actions, na, aid, 1), sched.timestep(aid), inputs["state"], inputs["context"],
                        inputs["clip_feature"], mask=mask)
        loss = flow_matching_losses(sched, out.video_pred, out.action_pred, clean, noise, actions, na, tid, aid,
                                    torch.ones_like(actions, dtype=torch.bool), torch.ones(mbs, dtype=torch.bool, device="cuda")).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]) if a else 4, int(a[1]) if len(a) > 1 else 32, (a[2] != "0") if len(a) > 2 else True,
         a[3] if len(a) > 3 else "full")
