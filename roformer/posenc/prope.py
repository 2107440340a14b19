"""p-RoPE (Barbero et al. 2024): RoPE whose lowest frequencies are set to zero."""

import jax
import jax.numpy as jnp


def num_truncated(num_frequencies: int, rope_truncate: float) -> int:
  """How many of the lowest frequencies stop rotating: d/2 - floor(p * d/2), p = 1 - rope_truncate.

  The rotating ones are counted as Gemma's and Hugging Face's proportional RoPE count them
  (`int(p * d/2)` kept), so a fraction that does not split d/2 evenly truncates the extra one:
  head_dim 64 at rope_truncate=0.2 keeps 25 of 32 frequencies, not 26.
  """
  # The tiny epsilon keeps e.g. 0.7 * 10 = 6.9999... from losing a frequency to rounding.
  return num_frequencies - int((1.0 - rope_truncate) * num_frequencies + 1e-9)


def truncate_frequencies(inv_freq: jax.Array, rope_truncate: float) -> jax.Array:
  """p-RoPE: the last `num_truncated` inverse frequencies (the lowest) become 0.

  RoPE's theta_i = b^(-2i/d) decrease with i, so the tail holds the lowest frequencies. A
  zero frequency is angle 0 at every position: those pairs pass through unrotated and act as
  position-free semantic channels. p-RoPE's p (the fraction still rotating) is 1 - rope_truncate.

  Args:
    inv_freq: float32 [d/2], decreasing.
    rope_truncate: in [0, 1).

  Returns:
    float32 [d/2].
  """
  n = num_truncated(inv_freq.shape[-1], rope_truncate)
  if n == 0:
    return inv_freq
  keep = jnp.arange(inv_freq.shape[-1]) < inv_freq.shape[-1] - n
  return jnp.where(keep, inv_freq, 0.0).astype(inv_freq.dtype)
