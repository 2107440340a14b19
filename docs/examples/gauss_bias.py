"""A positional encoding kept outside the repository: a learned Gaussian distance bias.

    bias_h(i, j) = -(i - j)^2 / (2 sigma_h^2),  sigma_h > 0 learned per head

Registered under posenc.kind="gauss" with one field of its own, posenc.gauss_init_sigma.
docs/extending.md walks through it; tests/extending_test.py trains, resumes, evaluates and
samples from it with the repository's CLIs, from a temporary directory.
"""

import dataclasses
import math

import jax.numpy as jnp
from flax import nnx

from roformer import posenc


@posenc.register("gauss")
class GaussBias(posenc.PosEnc):
  """Gaussian distance bias: -(i - j)^2 / (2 sigma_h^2), sigma_h learned per head."""

  @dataclasses.dataclass(frozen=True)
  class Fields(posenc.PosEnc.Fields):
    gauss_init_sigma: float = posenc.param(16.0, "initial sigma_h of every head, in positions")

  @classmethod
  def check_config(cls, cfg, *, causal, head_dim):
    super().check_config(cfg, causal=causal, head_dim=head_dim)
    if not cfg.gauss_init_sigma > 0:
      raise ValueError(f"posenc.gauss_init_sigma={cfg.gauss_init_sigma} must be > 0")

  def __init__(self, cfg, *, num_heads, rngs, **kwargs):
    super().__init__(cfg, num_heads=num_heads, rngs=rngs, **kwargs)
    # log sigma, so sigma stays positive whatever the optimizer does; one per head ('heads').
    init = nnx.with_partitioning(
      nnx.initializers.constant(math.log(cfg.gauss_init_sigma)), ("heads",)
    )
    self.log_sigma = nnx.Param(init(rngs.params(), (num_heads,), self.param_dtype))

  def bias(self, qpos_BL, kpos_BS):
    """float32 [B, H, L, S] for integer positions qpos [B, L] and kpos [B, S]."""
    distance_BLS = (qpos_BL[:, :, None] - kpos_BS[:, None, :]).astype(jnp.float32)
    sigma_H = jnp.exp(self.log_sigma[...].astype(jnp.float32))
    return -(distance_BLS[:, None] ** 2) / (2.0 * sigma_H[None, :, None, None] ** 2)
