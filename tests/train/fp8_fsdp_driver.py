"""torchrun entry for tests/train/test_fp8_training.py: `train` with FP8 let through on this CPU (whose torch runs
torch._scaled_mm), so that the FP8 linears run under FSDP2 in two processes."""

import json
import sys

from dzmodel.train import trainer
from dzmodel.train.config import TrainConfig

trainer.resolve_precision = lambda requested, device, **_: (requested, None)
trainer.train(TrainConfig.from_dict(json.loads(open(sys.argv[1]).read())))
