"""Teacher-forced check of a converted model through the evaluation path: `dz eval oracle` replays a recording's own
actions (so every episode follows its demonstration and succeeds), and at every query the model is asked for its
chunk from the same observation (the episode's history in its KV cache, as in evaluation). Prints the mean absolute
difference between the model's chunk and the demonstration's, in normalised action units (q01..q99 -> -1..1), per
action dimension, and the first action of each chunk. Small errors here and failures in closed loop mean the model
imitates the expert on the expert's own states and fails once it leaves them.

    python docs/archive/results/shadow_oracle.py MODEL_DIR DATASET OUT [EPISODES]
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch

import dzmodel.eval.oracle as oracle
from dzmodel.policy.policy import load_policy


def main() -> None:
    model_dir, dataset, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    episodes = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    torch.set_num_threads(2)
    real = load_policy(model_dir, "cpu")
    errors = []

    class Shadow(oracle.ReplayModel):
        def predict_batch(self, observations):
            replay = [self.predict_actions(o) for o in observations]
            predicted = real.policy.predict_batch([dict(o) for o in observations])
            for o, r, p in zip(observations, replay, predicted):
                h = real.action_horizon
                rn, pn = self.action_stats.normalize(np.asarray(r)[:h]), self.action_stats.normalize(np.asarray(p)[:h])
                errors.append({"session": str(o["session_id"]), "chunk": self.sessions[str(o["session_id"])] - 1,
                               "abs_error": np.abs(rn - pn).mean(0).round(4).tolist(),
                               "demo_first": rn[0].round(3).tolist(), "model_first": pn[0].round(3).tolist()})
            return replay

    oracle.ReplayModel = Shadow
    oracle.run_oracle(dataset, out, metadata=model_dir / "experiment_cfg" / "metadata.json",
                      embodiment=real.embodiment.tag, max_episodes=episodes, workers=2, progress=False)
    (out / "shadow.json").write_text(json.dumps(errors, indent=1) + "\n")
    e = np.array([x["abs_error"] for x in errors])
    print(f"{len(errors)} chunks; mean |model - demo| per action dim (normalised): {e.mean(0).round(3).tolist()}, "
          f"all dims {e.mean():.3f}")
    for x in errors:
        print(x["session"], x["chunk"], f"{np.mean(x['abs_error']):.3f}", "demo", x["demo_first"], "model", x["model_first"])


if __name__ == "__main__":
    main()
