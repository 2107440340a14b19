"""Frozen configuration of the input pipeline."""

import dataclasses

from roformer.fields import param

SOURCES = ("pystdlib", "files", "hub", "synthetic")
# Fields only one source reads, unset when "" or False: setting one for another source is an error.
SOURCE_FIELDS = {
  "files": ("files", "validation_files", "test_files"),
  "hub": ("hub_name", "hub_config", "streaming"),
}
TOKENIZERS = ("bytes", "bpe", "wordpiece")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  source: str = param(
    "pystdlib",
    '"pystdlib" (this interpreter\'s standard library sources), "files", "hub" or "synthetic" (a '
    "generated task, data.task; decoders only).",
  )
  files: str = param(
    "", "files: glob of .txt / .jsonl / .parquet training files (comma-separated globs allowed)."
  )
  validation_files: str = param(
    "",
    "files: glob of validation files; empty = hold out the last validation_fraction of the corpus.",
  )
  test_files: str = param("", 'files: glob of test files ("" = no test split).')
  validation_fraction: float = param(
    0.05, "Fraction of the corpus held out for validation when there are no validation files."
  )
  text_field: str = param("text", "Column (.jsonl / .parquet / hub) holding the text.")
  text_encoding: str = param(
    "utf-8",
    'files: text encoding of .txt / .jsonl files (any Python codec name, e.g. "latin-1").',
  )
  hub_name: str = param("", "hub: dataset name on the Hugging Face hub.")
  hub_config: str = param("", 'hub: dataset configuration name ("" = default).')
  hub_train_split: str = param("train", "hub: split used for training.")
  hub_validation_split: str = param(
    "validation",
    'hub: split used for validation ("" = hold out the last validation_fraction of train).',
  )
  hub_test_split: str = param("test", 'hub: split used for testing ("" = no test split).')
  hub_max_documents: int = param(100_000, "hub, streaming: documents taken from each split.")
  streaming: bool = param(False, "hub: stream the dataset instead of downloading it whole.")
  tokenizer: str = param(
    "bytes",
    '"bytes" (no training needed), "bpe", "wordpiece" (trained on the training split and saved '
    "as DIR/tokenizer.json) or a path to a tokenizer.json.",
  )
  vocab_size: int = param(8192, "Vocabulary size of trained tokenizers (bpe, wordpiece).")
  tokenizer_max_chars: int = param(
    0, "Trained tokenizers learn from this many characters of the training split (0 = all)."
  )
  seq_len: int = param(
    512, "Training sequence length in tokens (also the length of the periodic evaluation)."
  )
  pack: bool = param(
    False, "Decoder: pack documents with segment ids instead of joining them with EOS."
  )
  mlm_probability: float = param(
    0.15, "Encoder: fraction of tokens masked (80% [MASK], 10% random, 10% unchanged)."
  )
  cache_dir: str = param(
    "", 'Where tokenized corpora are cached: "" = $ROFORMER_CACHE or ~/.cache/roformer.'
  )
  task: str = param(
    "copy",
    "synthetic: the task, one of copy, reverse, sort, addition, associative_recall, passkey "
    "(roformer/data/synthetic.py) or RULER's niah_multikey, niah_multivalue, variable_tracking, "
    "common_words, frequent_words (roformer/data/ruler.py); the loss covers the answer tokens "
    "only.",
  )
  task_min_len: int = param(
    8,
    "synthetic: shortest training task length; training lengths are drawn uniformly from "
    "[task_min_len, task_max_len] (symbols to copy, digits per operand, key-value pairs, filler "
    "tokens, words in the list; common_words needs >= 19, frequent_words >= 53).",
  )
  task_max_len: int = param(
    32, "synthetic: longest training task length (data.seq_len must hold an example of it)."
  )
  task_lsb_first: bool = param(
    False, "synthetic addition: write every number least significant digit first."
  )
