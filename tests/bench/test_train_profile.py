"""`dz bench profile`: kernel grouping and the busy / exposed-communication / idle accounting of a trace."""

import pytest

from dzmodel.bench.train_profile import categorize, summarize_trace


def _kernel(name, ts, dur):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_kernels_fall_into_the_expected_categories():
    assert categorize("nvjet_sm90_tst_256x152_64x4_2x1_v_bz_coopA_bias_TNT") == "matmul"
    assert categorize("triton_tem_fused__to_copy_flex_attention_backward_transpose_view_30") == "attention"
    assert categorize("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26") == "attention"
    assert categorize("triton_red_fused__to_copy_add_mul_native_layer_norm_6") == "fused elementwise (compiled)"
    # an FP8 cast that Inductor names after the matmul it feeds is elementwise work; its matmul templates are not
    assert categorize("triton_poi_fused__scaled_mm__to_copy_clamp_clone_constant_pad_nd_mul_reciprocal_t_view_14") \
        == "fused elementwise (compiled)"
    assert categorize("triton_tem_fused_addmm_3") == "matmul"
    assert categorize("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL") == "communication"
    assert categorize("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>") == "eager elementwise"
    assert categorize("some_custom_kernel") == "other"


def test_summary_separates_overlapped_and_exposed_communication_and_idle_time():
    trace = {"traceEvents": [
        _kernel("nvjet_gemm", 0, 1000),                 # compute 0-1 ms
        _kernel("ncclDevKernel_AllGather", 500, 1000),  # 0.5-1.5 ms: half hidden under the GEMM
        _kernel("triton_poi_fused_add", 1500, 500),     # compute 1.5-2 ms
        _kernel("triton_poi_fused_mul", 3000, 1000),    # idle 2-3 ms, then compute 3-4 ms
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 4000},  # not a kernel: ignored
    ]}
    s = summarize_trace(trace)
    assert s.step_ms == pytest.approx(4.0)
    assert s.compute_busy_ms == pytest.approx(2.5)
    assert s.exposed_comm_ms == pytest.approx(0.5)
    assert s.idle_ms == pytest.approx(1.0)
    assert s.by_category["communication"] == pytest.approx(1.0)
    assert s.by_category["fused elementwise (compiled)"] == pytest.approx(1.5)
    assert s.top[0] == ("nvjet_gemm", 1, pytest.approx(1.0))


def test_a_trace_without_kernels_is_refused():
    with pytest.raises(ValueError, match="no GPU kernel events"):
        summarize_trace({"traceEvents": [{"cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}]})


def test_linear_layers_times_each_block_linear_in_bf16_and_fp8(monkeypatch):
    import dzmodel.model.fp8 as fp8
    from dzmodel.bench.train_profile import block_linear_shapes, linear_layers
    from dzmodel.model.args import preset
    from dzmodel.model.attention import latent_layout

    fp8_inputs = []
    real = fp8._Float8Matmul.apply
    monkeypatch.setattr(fp8._Float8Matmul, "apply", lambda x, *rest: fp8_inputs.append(tuple(x.shape)) or real(x, *rest))
    rows = linear_layers("tiny", (4, 8), micro_batch=2, device="cpu", compile=False)
    args = preset("tiny")
    shapes = block_linear_shapes(args, latent_layout(args, (4, 8)).seq_len * 2)
    assert [r["piece"] for r in rows[:-1]] == [f"{name} [{m}x{k}]->{n}" for name, m, k, n in shapes]
    # the FP8 rows ran the FP8 matmul, at every layer's shape
    assert set(fp8_inputs) == {(m, k) for _, m, k, _ in shapes}
    for r in rows[:-1]:
        assert r["bf16_ms"] > 0 and r["fp8_ms"] > 0 and r["fp8_speedup"] == round(r["bf16_ms"] / r["fp8_ms"], 3)
    assert rows[-1]["piece"] == "one block's linears"
    assert abs(rows[-1]["bf16_ms"] - sum(r["bf16_ms"] for r in rows[:-1])) < 1e-2
