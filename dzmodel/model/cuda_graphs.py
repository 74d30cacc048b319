"""CUDA graphs of fixed-shape inference work (the prefill and the flow solver), one per input shape.

One 5B solver step is ~2,000 small kernels; launched one by one from Python they cost more host time than the
GPU spends on them (docs/performance.md). A CUDA graph replays a whole captured call with one launch. The
inputs are copied into the graph's static buffers, so a KV cache of a given length always has the same
shape: a session's cache is one of a few lengths (frame 0, then whole blocks), and each length is captured
once. Off CUDA, or when disabled, the function simply runs (the same code path that gets captured).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Sequence

import torch


# Graphs kept before the least recently used one is dropped. A LIBERO evaluation of the small preset meets 30 shapes
# (solver and prefill, two cache lengths each, and the image encoder and the VAE's start, batches of 1-16 padded to
# powers of two), more when a longer prompt raises the text rows kept: a cap below that recaptures in a cycle (380
# captures for 1,930 calls at 16 with 20 shapes). Each kept graph holds copies of its inputs (the KV cache it reads).
MAX_GRAPHS = 48


class GraphCache:
    """fn(*inputs) -> tuple of tensors, captured once per (key, input shapes) and replayed after."""

    def __init__(self, enabled: bool, max_graphs: int = MAX_GRAPHS, capture: bool = True):
        self.enabled = enabled   # callers route their work through run() (flattened inputs) only when enabled
        self.capture = capture   # False: run() calls the function directly, and counts captures and replays as the
        #                          GPU would (tests the same path and the cache's bookkeeping on CPU)
        self.max_graphs = max_graphs
        self._graphs: OrderedDict = OrderedDict()
        self._pool = None
        self.captures = 0   # counted for the guard tests and the bench
        self.replays = 0

    def run(self, key: Hashable, make_fn: Callable[[], Callable], inputs: Sequence[torch.Tensor]) -> tuple:
        if not self.enabled:
            return tuple(make_fn()(*inputs))
        full_key = (key, tuple((tuple(x.shape), x.dtype) for x in inputs))
        if full_key in self._graphs:
            self._graphs.move_to_end(full_key)
        else:
            self._graphs[full_key] = self._capture(make_fn(), inputs) if self.capture else None
            self.captures += 1
            if len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
        entry = self._graphs[full_key]
        self.replays += 1
        if not self.capture:
            return tuple(make_fn()(*inputs))
        static_in, graph, static_out = entry
        for buf, x in zip(static_in, inputs):
            buf.copy_(x)
        graph.replay()
        # the graphs share one memory pool and run one at a time: copy the outputs out before the next replay
        return tuple(o.clone() for o in static_out)

    def _capture(self, fn: Callable, inputs: Sequence[torch.Tensor]):
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        static_in = [x.clone() for x in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture: cuBLAS / cuDNN choose their kernels here
            for _ in range(2):
                fn(*static_in)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            static_out = tuple(fn(*static_in))
        return static_in, graph, static_out

    def clear(self) -> None:
        self._graphs.clear()
