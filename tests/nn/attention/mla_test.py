"""Tests of multi-head latent attention (roformer/nn/attention/mla.py)."""

import jax.numpy as jnp
import numpy as np
import pytest

from roformer import testing
from roformer.nn.attention import kv_cache
from roformer.posenc.config import RopeScaling
from roformer.posenc.rope_scaling import mla_softmax_factor

MLA = dict(attention="mla", num_kv_heads=0, kv_lora_rank=6, qk_rope_head_dim=4)


def _yarn(**fields):
  return {"scaling": RopeScaling(kind="yarn", factor=4.0, original_max_len=4, **fields)}


@pytest.mark.parametrize(
  "posenc, fields, q_lora_rank",
  [
    ("rope", None, 0),
    ("rope", _yarn(mscale=0.707, mscale_all_dim=0.707), 5),
    ("rope", {"scaling": RopeScaling(kind="dynamic", factor=2.0, original_max_len=4)}, 0),
    ("alibi", None, 5),
  ],
)
def test_cached_mla_generation_equals_full_forward(posenc, fields, q_lora_rank):
  testing.check_cached_generation(
    testing.tiny_model_config(posenc, fields, q_lora_rank=q_lora_rank, **MLA)
  )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cache_holds_the_latent_and_rotary_key_only(dtype):
  model = testing.random_model(testing.tiny_model_config(dtype=dtype, **MLA))
  caches = model.init_caches(2, 10)
  per_token = kv_cache.nbytes(caches[0]) / (2 * 10)
  assert per_token == (6 + 4) * jnp.dtype(dtype).itemsize
  assert len(caches) == testing.TINY_MODEL.num_layers


def test_mla_parameters_and_rotary_width():
  model = testing.random_model(testing.tiny_model_config(q_lora_rank=5, **MLA))
  attn = model.layers[0].attn
  assert attn.kv_down.kernel.shape == (16, 6 + 4)  # latent + shared rotary key
  assert attn.kv_up.kernel.shape == (6, 4, 2 * 4)  # per head: keys and values of head_dim 4
  assert attn.q_up.kernel.shape == (5, 4, 4 + 4)
  assert model.posenc.head_dim == 4  # the encoding rotates the rotary parts only


def test_yarn_softmax_factor_is_deepseeks_mscale_squared():
  # 0.1 * 0.707 * ln 4 + 1 = 1.0980113, squared.
  got = mla_softmax_factor(_yarn(mscale=0.707, mscale_all_dim=0.707)["scaling"])
  np.testing.assert_allclose(got, 1.2056288, rtol=1e-6)
  assert mla_softmax_factor(_yarn()["scaling"]) == 1.0  # no mscale_all_dim: HF's factor only
  assert mla_softmax_factor(None) == 1.0


def test_mla_config_errors_name_the_fields():
  from roformer.nn.config import validate_model

  with pytest.raises(ValueError, match="model.kv_lora_rank"):
    validate_model(testing.tiny_model_config(attention="mla", num_kv_heads=0))
  with pytest.raises(ValueError, match="model.num_kv_heads"):
    validate_model(testing.tiny_model_config(**{**MLA, "num_kv_heads": 2}))
  with pytest.raises(ValueError, match="model.attention"):
    validate_model(testing.tiny_model_config(attention="sparse"))
