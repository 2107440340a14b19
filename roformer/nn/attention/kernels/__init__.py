"""The attention kernels behind one contract (base.py): `kernel(q, k, v, qpos, kpos, call)` with
`call` an `AttentionCall` (call.py), one file per kernel, each registered in `KERNELS` under
its `model.attention_impl` name.

  dense       the reference: materialised [L, S] scores, every call
  chunked     blockwise online softmax, memory O(L * block), banded under windows
  auto        the fastest kernel the call fits on its platform (`AUTO_ORDER`), else dense/chunked
  splash      TPU: Pallas splash attention (biases folded into q and k)
  flash_bias  TPU: Pallas flash attention with a dense logit bias
  cudnn       GPU: cuDNN through `jax.nn.dot_product_attention`
  cpu_flash   CPU: a fused C++ kernel, built on first use

Shared: padding.py (sequences and heads padded to a kernel's tile), sharding.py (an opaque call
split over the mesh). Every kernel agrees with `roformer.nn.attention.oracle.reference_attention`
(tests/nn/attention/conformance_test.py runs each registered kernel against it).
"""

from roformer.nn.attention.call import AttentionCall, Features
from roformer.nn.attention.kernels import (  # each module registers its kernel
  auto,
  chunked,
  cpu_flash,
  cudnn,
  dense,
  flash_bias,
  splash,
)
from roformer.nn.attention.kernels.auto import AUTO_ORDER, auto_attention
from roformer.nn.attention.kernels.base import (
  KERNELS,
  Kernel,
  refuse,
  register_kernel,
  target_platform,
)
from roformer.nn.attention.kernels.chunked import chunked_attention
from roformer.nn.attention.kernels.dense import dense_attention

__all__ = [
  "AUTO_ORDER",
  "KERNELS",
  "AttentionCall",
  "Features",
  "Kernel",
  "auto",
  "auto_attention",
  "chunked",
  "chunked_attention",
  "cpu_flash",
  "cudnn",
  "dense",
  "dense_attention",
  "flash_bias",
  "refuse",
  "register_kernel",
  "splash",
  "target_platform",
]
