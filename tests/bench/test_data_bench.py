"""The data benchmark measures (smoke run at small sizes; the real run is `dz bench data`)."""

import pytest

from dzmodel.bench.data_bench import format_table, run_data_bench


@pytest.mark.slow
def test_data_bench_smoke(tmp_path):
    result = run_data_bench(tmp_path, views=1, num_frames=100, height=64, width=96, codecs=("libx264",), gops=(2,),
                            decode_samples=1, workers=(1,), loader_samples=2, verbose=False)
    text = format_table(result)
    assert "torchcodec" in text.lower() or "ms" in text
    flat = repr(result)
    assert "nan" not in flat.lower()
