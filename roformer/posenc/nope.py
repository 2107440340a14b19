"""NoPE: no positional encoding; a causal decoder infers order from its mask alone."""

from roformer.posenc.base import PosEnc
from roformer.posenc.registry import register


@register("nope")
class NoPE(PosEnc):
  """No positional encoding (Kazemnejad et al. 2023): a causal decoder infers order by its mask.

  Decoders only: without a causal mask, attention and every position-wise layer are
  permutation-equivariant, so an encoder without positions is exactly a bag of words.
  """

  causal_only = True
  causal_reason = (
    "without a causal mask an encoder is permutation-equivariant (a bag of words) and cannot "
    "learn word order"
  )
  # The paper's models are Hugging Face T5 decoders: tokens N(0, 1), tied logits times d^-0.5.
  paper_embed_scale = "sqrt_d"
  reads_positions = False
