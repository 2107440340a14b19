"""Frozen configuration of the input pipeline."""

import dataclasses

SOURCES = ("pystdlib", "files", "hub", "synthetic")
# Fields only one source reads, unset when "" or False: setting one for another source is an error.
SOURCE_FIELDS = {
  "files": ("files", "validation_files", "test_files"),
  "hub": ("hub_name", "hub_config", "streaming"),
}
TOKENIZERS = ("bytes", "bpe", "wordpiece")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  source: str = "pystdlib"  # pystdlib | files | hub | synthetic
  files: str = ""  # files: glob of .txt / .jsonl / .parquet (comma-separated globs allowed)
  validation_files: str = ""  # files: optional glob; else the last validation_fraction is held out
  test_files: str = ""  # files: optional glob of a test split ("" = the source has no test split)
  validation_fraction: float = 0.05
  text_field: str = "text"  # .jsonl / .parquet / hub column holding the text
  text_encoding: str = "utf-8"  # files: encoding of .txt / .jsonl files
  hub_name: str = ""
  hub_config: str = ""
  hub_train_split: str = "train"
  hub_validation_split: str = "validation"  # "" = hold out the last validation_fraction of train
  hub_test_split: str = "test"  # "" = no test split
  hub_max_documents: int = 100_000  # streaming: documents taken from each split
  streaming: bool = False
  tokenizer: str = "bytes"  # bytes | bpe | wordpiece | path/to/tokenizer.json
  vocab_size: int = 8192  # for trained tokenizers (bpe, wordpiece)
  tokenizer_max_chars: int = 0  # trained tokenizers learn from this many characters (0 = all)
  seq_len: int = 512
  pack: bool = False  # decoder: pack documents with segment ids instead of joining with EOS
  mlm_probability: float = 0.15
  cache_dir: str = ""  # "" = $ROFORMER_CACHE or ~/.cache/roformer
  # synthetic: copy | reverse | sort | addition | associative_recall | passkey | niah_multikey |
  # niah_multivalue | variable_tracking | common_words | frequent_words
  task: str = "copy"
  task_min_len: int = 8  # synthetic: shortest training task length
  task_max_len: int = 32  # synthetic: longest training task length
  task_lsb_first: bool = False  # synthetic addition: numbers least significant digit first
