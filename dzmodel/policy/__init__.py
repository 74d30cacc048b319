"""The policy: a converted checkpoint behind the embodiment's IO pipeline, one session (KV cache) per robot.
Below `eval` and `serve` (both load their policy here), above `train`, `model` and `data`; the IO pipeline it
composes is `dzmodel.data.transforms.EmbodimentIO`, shared with the training loaders."""
