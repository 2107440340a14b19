"""Tests of roformer/train/init_from.py: starting from a Hugging Face RoFormer checkpoint."""

import jax
import numpy as np
import pytest
from flax import nnx

from roformer import config as config_lib
from roformer import testing
from roformer.infra import sharding
from roformer.nn.model import make_model
from roformer.train import init_from


@pytest.mark.slow
def test_init_from_hf_roformer_loads_its_parameters():
  from roformer import hf

  path = testing.FIXTURES / "hf_roformer_tiny"
  loaded = hf.load_hf_roformer(str(path))
  mesh = sharding.make_mesh(config_lib.MeshConfig())
  make = lambda: make_model(loaded.config, rngs=nnx.Rngs(1))  # noqa: E731
  _, abstract = sharding.abstract_state(make, mesh, config_lib.MeshConfig().rules)
  state = init_from.load_init_state(str(path), abstract)
  expected = jax.tree.leaves(nnx.state(loaded.model))
  assert len(expected) == len(jax.tree.leaves(state))
  for a, b in zip(jax.tree.leaves(state), expected, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
