"""benchmarks/memory_report.py: XLA's buffer assignment of the train step, summed by shape."""

import jax

from benchmarks import bench_step, memory_report
from roformer.testing import config_file_with

REPORT = """\
Memory Space: default (color=0)
Total bytes: 3670016 (3.50MiB)
  cumulative_size;       size;       offset; used_by_n_values; shapes_list
  ------------------------------------------------------------
    2.00MiB( 57%);    2.00MiB;            0;                3; f32[8,64], 2×f32[512,1024]
    3.00MiB( 85%);    1.00MiB;      2097152;                2; bf16[1024,512], s32[16]
    3.50MiB(100%);  512.00KiB;      3145728;                2; f32[128,1024], pred[]
"""


def test_allocations_go_to_their_largest_value_and_sum_by_shape(tmp_path):
  path = tmp_path / "report.txt"
  path.write_text(REPORT)
  # The first allocation lists a small value first: it still counts as f32[512,1024].
  assert memory_report.allocations(str(path)) == [
    (2 << 20, "f32[512,1024]"),
    (1 << 20, "bf16[1024,512]"),
    (512 << 10, "f32[128,1024]"),
  ]
  assert memory_report.by_shape(str(path), 2) == [
    ("f32[512,1024]", 1, 2 << 20),
    ("bf16[1024,512]", 1, 1 << 20),
  ]


def _largest_shapes(tmp_path, mlp_dim):
  overrides = {"model.mlp_dim": mlp_dim, "model.remat": "none", "mesh.data": 1, "mesh.fsdp": 1}
  config = config_file_with("configs/tpu_compile_tiny.py", overrides)
  config.train.global_batch_size = 4
  dump = tmp_path / f"mlp{mlp_dim}"
  bench_step.compile_train_step(bench_step.run_config(config), jax.devices()[:1], str(dump))
  return [shape for shape, _, _ in memory_report.by_shape(memory_report.report_of(str(dump)), 3)]


def test_a_wide_mlp_tops_the_report_of_the_compiled_step(tmp_path):
  # 4 x 128 tokens: a 4096-wide MLP keeps [512, 4096] float32 activations (8 MiB each) per
  # layer, the largest arrays of the step; at 64 wide nothing of that width exists.
  wide = _largest_shapes(tmp_path, 4096)
  assert any(",4096]" in shape for shape in wide), wide
  narrow = _largest_shapes(tmp_path, 64)
  assert not any("4096" in shape for shape in narrow), narrow
