"""The per-layer encodings, QK-norms, query temperatures, Resonance RoPE, attention sinks and FoX's
forget gate give the same logits in the chunked kernel (and its banded path under windows) as in
the dense one."""

import numpy as np
import pytest

from roformer import testing

OPTIONS = [
  ("rope", dict(layer_pattern="rope,nope", max_wavelength_pattern="100,1000000"), {}),
  ("rope", {}, dict(qk_norm="rmsnorm")),
  ("rope", {}, dict(qk_norm="l2")),
  ("rope", dict(query_scale="logn", query_scale_len=4), {}),
  ("rope", dict(query_scale="ssmax"), {}),
  ("rope", dict(query_scale="llama4", query_scale_floor=3.0), {}),
  ("rope", dict(rope_resonance=True), {}),
  ("rope", dict(layer_pattern="rope,rope,nope", query_scale="llama4", query_scale_floor=3.0,
                query_scale_kinds="nope"),
   dict(num_layers=3, attention_window_pattern="5,5,0", attention_window_kind="chunked",
        qk_norm="l2", qk_norm_kinds="rope")),  # iRoPE
  ("rope", dict(layer_pattern="rope,rope,nope"),
   dict(num_layers=3, attention_window_pattern="5,5,0")),  # RNoPE-SWA
  ("rope", {}, dict(attention_sinks=True)),
  ("alibi", {}, dict(attention_sinks=True, attention_window_pattern="5,0")),  # banded + chunked
  ("nope", {}, dict(forget_gate=True)),  # FoX as the paper runs it
  ("alibi", {}, dict(forget_gate=True, attention_window_pattern="5,0")),
]  # fmt: skip


@pytest.mark.parametrize("posenc, posenc_fields, fields", OPTIONS)
def test_chunked_kernel_logits_equal_dense_logits(posenc, posenc_fields, fields):
  tokens, pos = testing.random_tokens(2, 21), testing.arange_positions(2, 21, start=2)
  logits = {}
  for impl in ("dense", "chunked"):
    cfg = testing.tiny_model_config(
      posenc, posenc_fields, attention_impl=impl, attention_block=4, **fields
    )
    logits[impl] = testing.forward(testing.random_model(cfg), tokens, pos)
  np.testing.assert_allclose(logits["chunked"], logits["dense"], rtol=1e-5, atol=1e-5)
