"""Test-wide settings."""

import faulthandler
import sys

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")

# A crash (e.g. in native code) prints the crashing thread's Python stack only: the idle threads
# of libraries (TensorBoard writers, progress bars) would bury it. pytest's own faulthandler,
# which prints every thread, is off (pyproject.toml).
faulthandler.enable(file=sys.stderr, all_threads=False)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops JAX's caches of compiled programs after each test module: no later test reuses the
  programs of another module's shapes, and the process need not hold them all."""
  yield
  jax.clear_caches()
