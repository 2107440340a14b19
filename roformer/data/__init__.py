"""Input pipeline: sources, tokenizers, cached token arrays, training batches, eval windows."""

from roformer.data.batches import MODEL_KINDS, TrainBatches
from roformer.data.config import SOURCES, TOKENIZERS, DataConfig
from roformer.data.corpus import Corpus, load_corpus
from roformer.data.masking import max_predictions, mlm_mask
from roformer.data.sources import SPLITS, Source, make_source
from roformer.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer
from roformer.data.windows import PROTOCOLS, EvalWindows, eval_windows, right_context
from roformer.errors import DataError

__all__ = [
  "MODEL_KINDS",
  "PROTOCOLS",
  "SOURCES",
  "SPLITS",
  "TOKENIZERS",
  "ByteTokenizer",
  "Corpus",
  "DataConfig",
  "DataError",
  "EvalWindows",
  "HFTokenizer",
  "Source",
  "Tokenizer",
  "TrainBatches",
  "build_tokenizer",
  "eval_windows",
  "right_context",
  "load_corpus",
  "make_source",
  "max_predictions",
  "mlm_mask",
]
