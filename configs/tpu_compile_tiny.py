"""A 2-layer, 64-wide decoder for checking the TPU compile path quickly (tests, smoke runs).

Run: python -m benchmarks.tpu_compile --config=configs/tpu_compile_tiny.py --topology=v4:2x2x2
"""

from configs import default


def get_config():
  config = default.get_config()
  config.model.num_layers = 2
  config.model.emb_dim = 64
  config.model.num_heads = 4
  config.model.mlp_dim = 256
  config.model.scan_layers = True
  config.model.remat = "block"
  config.data.seq_len = 128
  config.train.global_batch_size = 16
  # Batch over data x fsdp, parameters over fsdp: both kinds of sharding in one compile.
  config.mesh.data = 2
  config.mesh.fsdp = -1
  return config
