"""dzmodel must import (and build a model) with torch + safetensors + numpy alone: the GPU image has nothing else."""

import subprocess
import sys

BLOCKED = ["tokenizers", "transformers", "yaml", "prefect", "mlflow", "dvc", "lerobot", "huggingface_hub",
           "pyarrow", "torchcodec", "av", "pydantic"]

SCRIPT = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in {BLOCKED!r}:
            raise ImportError('blocked for this test: ' + name)
sys.meta_path.insert(0, Block())
import pkgutil, importlib, dzmodel, dzmodel.model
for m in pkgutil.walk_packages(dzmodel.__path__, 'dzmodel.'):
    importlib.import_module(m.name)
import torch
from dzmodel.model.args import preset
from dzmodel.model.wam import DreamZeroWAM
from dzmodel.model.components import build_encoders
DreamZeroWAM(preset('tiny')); build_encoders('tiny')
print('ok')
"""


def test_library_imports_without_pipeline_packages():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")
