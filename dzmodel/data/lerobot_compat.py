"""Importing lerobot 0.4.4 on a CPU-only torch: its torchvision import needs two operator schemas.

The only torchvision on PyPI for torch 2.13 is a CUDA build whose C++ ops cannot load on CPU torch;
its fake-kernel registrations then fail with "operator torchvision::nms does not exist". Defining
the two schemas first lets `import torchvision` (and so lerobot) succeed. Nothing here is needed on a
CUDA machine, where the real ops load.
"""

from __future__ import annotations

_LIB = None


def install_torchvision_shim() -> None:
    global _LIB
    if _LIB is not None:
        return
    import torch

    try:
        torch.ops.torchvision.nms  # the real ops are loaded: nothing to do
        return
    except (AttributeError, RuntimeError):
        pass
    _LIB = torch.library.Library("torchvision", "DEF")
    _LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIB.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")


def import_lerobot_dataset():
    """(LeRobotDatasetMetadata, LeRobotDataset) from lerobot 0.4.4, or an ImportError saying what is missing."""
    install_torchvision_shim()
    try:
        from lerobot.datasets.lerobot_dataset import LeRobotDataset, LeRobotDatasetMetadata
    except ImportError as exc:
        raise ImportError(f"lerobot 0.4.4 is not usable here ({exc}); `make setup` installs it") from exc
    return LeRobotDatasetMetadata, LeRobotDataset
