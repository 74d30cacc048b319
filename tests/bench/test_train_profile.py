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
