"""Resonance RoPE (Wang et al. 2024, arXiv 2403.00071): every wavelength rounded to an integer.

Pair i of RoPE rotates with wavelength lambda_i = 2 pi / theta_i, rarely an integer, so the
angles a pair takes at positions beyond the training length are angles it never saw. Rounding
each wavelength to the nearest integer and recomputing theta from it,

  lambda~_i = round(2 pi / theta_i),    theta~_i = 2 pi / lambda~_i,

makes every pair periodic in whole positions: the features of position p + lambda~_i are those of
position p, so a pair whose wavelength fits in the training length meets no new angle at any
length. It is applied to the frequencies a scaling produced (the paper's Resonance YaRN rounds
YaRN's interpolated frequencies; its code does the same after linear and NTK scaling), so
`posenc.rope_resonance` composes with every `posenc.scaling`.
"""

import math

import jax
import jax.numpy as jnp


def resonance_frequencies(inv_freq: jax.Array) -> jax.Array:
  """theta~_i = 2 pi / round(2 pi / theta_i), float32 [d/2] (theta_i <= 1, so lambda_i >= 2 pi).

  Frequencies are at most 1 (every base > 1, every scaling divides), so each wavelength is at
  least 2 pi and rounds to 6 or more; float32 holds the rounded integers exactly up to 2^24.
  """
  two_pi = jnp.float32(2.0 * math.pi)
  wavelength = jnp.round(two_pi / inv_freq.astype(jnp.float32))
  return (two_pi / wavelength).astype(jnp.float32)
