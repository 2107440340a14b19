"""Every configuration field with its default; other configs import this and override a few.

Run: python train.py --config=configs/default.py --workdir=DIR [--config.group.field=value ...]
"""

import ml_collections

from roformer.config import posenc_defaults

# Logical parameter axis -> mesh axes. 'batch' shards the data over data x fsdp; parameters are
# split over fsdp on their model dimension and over tensor on heads / mlp / vocabulary.
DEFAULT_RULES = (
  ("batch", ("data", "fsdp")),
  ("embed", "fsdp"),
  ("mlp", "tensor"),
  ("heads", "tensor"),
  ("kv", None),
  ("vocab", "tensor"),
)


def get_config() -> ml_collections.ConfigDict:
  """The default configuration: a 6-layer RoPE decoder LM on the Python standard library bytes."""
  config = ml_collections.ConfigDict()

  # ---- model: the Transformer (the vocabulary size comes from the tokenizer) ----
  config.model = model = ml_collections.ConfigDict()
  # "decoder" (causal LM, next-token loss) or "encoder" (BERT-style masked LM).
  model.kind = "decoder"
  # Number of Transformer blocks.
  model.num_layers = 6
  # Width of the residual stream (D).
  model.emb_dim = 512
  # Number of query heads (H).
  model.num_heads = 8
  # Number of key/value heads (G): 0 = num_heads (MHA), 1 = MQA, otherwise GQA (divides num_heads).
  model.num_kv_heads = 0
  # Per-head dimension (K): 0 = emb_dim // num_heads.
  model.head_dim = 0
  # Hidden width of the MLP (F).
  model.mlp_dim = 2048
  # Dropout on attention probabilities and residual branches during training (0 = off).
  model.dropout_rate = 0.0
  # Dropout on attention probabilities alone: -1 = model.dropout_rate. The fused kernels
  # (attention_impl splash, flash_bias, cudnn) have none: 0 runs them with residual dropout kept.
  model.attention_dropout_rate = -1.0
  # MLP activation: "gelu" or "swiglu".
  model.activation = "gelu"
  # Normalisation layer: "layernorm" or "rmsnorm".
  model.norm = "layernorm"
  # Epsilon of the normalisation layers.
  model.norm_eps = 1e-6
  # Encoder only: True = pre-LN blocks, False = post-LN (BERT / RoFormer). Decoders are pre-LN.
  model.pre_norm = False
  # Whether dense layers have biases.
  model.use_bias = True
  # Biases on the query, key and value projections only, with use_bias=False (Qwen2's layout).
  model.qkv_bias = False
  # Pre-LN blocks computing x + attn(norm1(x)) + mlp(norm2(x)): attention and MLP in parallel,
  # both reading the block's input (GPT-J, GPT-NeoX / Pythia). Encoders need pre_norm=True.
  model.parallel_residual = False
  # Share the input embedding with the output projection.
  model.tie_embeddings = True
  # Width of the token embeddings: 0 = emb_dim; otherwise they are projected up to emb_dim.
  model.embedding_size = 0
  # Number of token types (segment A/B embeddings): 0 = none.
  model.type_vocab_size = 0
  # Compute dtype: "float32" or "bfloat16" (softmax, norms and RoPE angles stay float32).
  model.dtype = "float32"
  # Parameter (and optimizer state) dtype.
  model.param_dtype = "float32"
  # Attention kernel: "dense" (materialises scores), "chunked" (blockwise) or "auto".
  model.attention_impl = "auto"
  # Query/key block of the chunked kernel, and the sequence block of blockwise evaluation.
  model.attention_block = 512
  # Sliding-window attention: keys within this many positions of the query (0 = all keys).
  model.attention_window = 0
  # How attention_window limits keys: "sliding" (within attention_window positions of the query),
  # "blockwise" (xPos's blockwise causal attention: the query's block of attention_window / 2
  # positions and the block before it) or "chunked" (Llama 4's chunked local attention: the
  # query's own chunk of attention_window positions).
  model.attention_window_kind = "sliding"
  # Token embeddings: "auto" = as the encoding's paper ("none" for learned and rope, "sqrt_d" for
  # the others; see docs/fidelity.md), "none" = BERT's N(0, 0.02^2) unscaled (a learned position
  # table likewise), "sqrt_d" = N(0, 1/d) multiplied by sqrt(d) (Vaswani et al., fairseq; a
  # learned position table N(0, 1/d) unscaled). Comparisons set one value for every encoding.
  model.embed_scale = "auto"
  # Stack the blocks' parameters ([num_layers, ...]) and run them with lax.scan: one block to
  # compile instead of num_layers (deep models compile faster). Checkpoints of the two layouts
  # differ, and Hugging Face imports need False.
  model.scan_layers = False
  # Rematerialisation of each block in the backward pass: "none" (store every activation),
  # "block" (store only matmul outputs; recompute scores, softmax, norms, activations) or "full"
  # (store only the block's input).
  model.remat = "none"
  # Per-layer windows "w1,w2,...", repeated over the layers (0 = global; "" = attention_window
  # everywhere), e.g. "4096,0" alternates local and global layers as Gemma 2.
  model.attention_window_pattern = ""
  # Encoders with a window: tokens at positions < N attend to and are attended by all (Longformer).
  model.global_tokens = 0
  # Attention kind: "softmax", "linear" (RoFormer eq. 19, RoPE in the numerator) or "mla"
  # (DeepSeek-V2 multi-head latent attention with a decoupled RoPE key).
  model.attention = "softmax"
  # linear: feature map "elu" (elu + 1) or "favor" (Performer's positive random features).
  model.linear_feature_map = "elu"
  # mla: width of the joint key/value latent (the decoding cache holds it per token).
  model.kv_lora_rank = 0
  # mla: width of the query latent (0 = queries projected directly).
  model.q_lora_rank = 0
  # mla: width of the rotary key shared by all heads (and of each query's rotary part).
  model.qk_rope_head_dim = 0
  # QK-norm: "none"; "rmsnorm" (per head over the head dim, a learned scale, before RoPE, as
  # Qwen3 and Gemma 3); "rmsnorm_whole" (over the whole query and key projections before the
  # heads are split, a learned scale, before RoPE, as OLMo 2); "l2" (per head, no scale, after
  # RoPE, as Llama 4). Softmax attention only.
  model.qk_norm = "none"
  # Kinds of posenc.layer_pattern whose layers apply qk_norm ("" = every layer; Llama 4: "rope").
  model.qk_norm_kinds = ""
  # A learned sink logit per query head that joins the softmax denominator as a key with no value
  # (gpt-oss), so a head can attend to nothing. Softmax attention only; every kernel and the cache.
  model.attention_sinks = False
  # FoX (Forgetting Transformer): a forget gate per head from the layer input whose cumulative
  # log-sigmoid sums bias the logits (c_i - c_j). Decoders, softmax attention; the paper runs it
  # with posenc.kind="nope". Every kernel and the cache.
  model.forget_gate = False

  # ---- posenc: the positional encoding (posenc.kind picks it) ----
  # The group is built from the encodings' own declarations (each PosEnc's `Fields`, and the
  # cross-cutting fields of roformer/posenc/config.py), so an encoding registered by a module the
  # config file imported brings its fields along. `python -m roformer.posenc` lists every field
  # with its default and doc.
  config.posenc = ml_collections.ConfigDict(posenc_defaults())

  # ---- data: corpus, tokenizer and windows ----
  config.data = data = ml_collections.ConfigDict()
  # "pystdlib" (this interpreter's standard library sources), "files", "hub" or "synthetic"
  # (a generated task, data.task; decoders only).
  data.source = "pystdlib"
  # files: glob of .txt / .jsonl / .parquet training files.
  data.files = ""
  # files: glob of validation files; empty = hold out the last validation_fraction of the corpus.
  data.validation_files = ""
  # files: glob of test files ("" = no test split).
  data.test_files = ""
  # Fraction of the corpus held out for validation when there are no validation files.
  data.validation_fraction = 0.05
  # Column (.jsonl / .parquet / hub) holding the text.
  data.text_field = "text"
  # files: text encoding of .txt / .jsonl files (any Python codec name, e.g. "latin-1").
  data.text_encoding = "utf-8"
  # hub: dataset name on the Hugging Face hub.
  data.hub_name = ""
  # hub: dataset configuration name ("" = default).
  data.hub_config = ""
  # hub: split used for training.
  data.hub_train_split = "train"
  # hub: split used for validation ("" = hold out the last validation_fraction of train).
  data.hub_validation_split = "validation"
  # hub: split used for testing ("" = no test split).
  data.hub_test_split = "test"
  # hub, streaming: documents taken from each split.
  data.hub_max_documents = 100_000
  # hub: stream the dataset instead of downloading it whole.
  data.streaming = False
  # "bytes" (no training needed), "bpe", "wordpiece" (trained on the training split and saved
  # as DIR/tokenizer.json) or a path to a tokenizer.json.
  data.tokenizer = "bytes"
  # Vocabulary size of trained tokenizers (bpe, wordpiece).
  data.vocab_size = 8192
  # Trained tokenizers learn from this many characters of the training split (0 = all).
  data.tokenizer_max_chars = 0
  # Training sequence length in tokens (also the length of the periodic evaluation).
  data.seq_len = 512
  # Decoder: pack documents with segment ids instead of joining them with EOS.
  data.pack = False
  # Encoder: fraction of tokens masked (80% [MASK], 10% random, 10% unchanged).
  data.mlm_probability = 0.15
  # Where tokenized corpora are cached: "" = $ROFORMER_CACHE or ~/.cache/roformer.
  data.cache_dir = ""
  # synthetic: the task, one of copy, reverse, sort, addition, associative_recall, passkey
  # (roformer/data/synthetic.py) or RULER's niah_multikey, niah_multivalue, variable_tracking,
  # common_words, frequent_words (roformer/data/ruler.py); the loss covers the answer tokens only.
  data.task = "copy"
  # synthetic: shortest training task length; training lengths are drawn uniformly from
  # [task_min_len, task_max_len] (symbols to copy, digits per operand, key-value pairs, filler
  # tokens, words in the list; common_words needs >= 19, frequent_words >= 53).
  data.task_min_len = 8
  # synthetic: longest training task length (data.seq_len must hold an example of it).
  data.task_max_len = 32
  # synthetic addition: write every number least significant digit first.
  data.task_lsb_first = False

  # ---- optim: AdamW with warmup then decay ----
  config.optim = optim = ml_collections.ConfigDict()
  # Peak learning rate (reached at the end of warmup).
  optim.learning_rate = 3e-4
  # Decay after warmup: "cosine", "linear" or "constant".
  optim.schedule = "cosine"
  # Steps of linear warmup from 0 to the peak learning rate.
  optim.warmup_steps = 1000
  # Learning rate at the last step, as a fraction of the peak (cosine and linear).
  optim.final_learning_rate_fraction = 0.1
  # Decoupled weight decay; norms, biases and other 1-D parameters are never decayed.
  optim.weight_decay = 0.1
  # Adam first-moment decay.
  optim.b1 = 0.9
  # Adam second-moment decay.
  optim.b2 = 0.95
  # Adam epsilon.
  optim.eps = 1e-8
  # Clip gradients to this global L2 norm (0 = no clipping).
  optim.grad_clip_norm = 1.0
  # Split each global batch into this many microbatches whose gradients are summed.
  optim.grad_accum_steps = 1

  # ---- train: the loop ----
  config.train = train = ml_collections.ConfigDict()
  # Sequences per optimizer step, over all devices and processes.
  train.global_batch_size = 64
  # Total optimizer steps (a rerun may raise it to continue training).
  train.num_train_steps = 100_000
  # Seed of parameter initialisation, data order and dropout.
  train.seed = 0
  # Write train metrics and a console line every this many steps.
  train.log_every_steps = 100
  # Evaluate on the validation split every this many steps (0 = only at the end).
  train.eval_every_steps = 2000
  # Validation targets scored per evaluation (0 = no evaluation).
  train.eval_max_tokens = 65_536
  # Windows per evaluation batch: 0 = train.global_batch_size.
  train.eval_batch_size = 0
  # Save a checkpoint every this many steps (0 = only at the end); always saved at the end.
  train.checkpoint_every_steps = 2000
  # Number of most recent checkpoints kept.
  train.keep_checkpoints = 3
  # Initialise parameters from another run's workdir (or its checkpoints/ directory), from a
  # Hugging Face RoFormer directory, or from a Hugging Face decoder directory (whose config.json
  # fixes model.* and posenc.*: configs/hf_decoder.py:DIR sets them); "" = random
  # initialisation. Ignored when resuming.
  train.init_from = ""

  # ---- mesh: device mesh and parameter sharding ----
  config.mesh = mesh = ml_collections.ConfigDict()
  # Data-parallel axis size (-1 = all remaining devices).
  mesh.data = -1
  # Fully-sharded data-parallel axis size: batch and parameters are split over it.
  mesh.fsdp = 1
  # Tensor-parallel axis size: heads, MLP and vocabulary are split over it.
  mesh.tensor = 1
  # Logical axis -> mesh axes rules (first match wins); see DEFAULT_RULES above.
  mesh.rules = DEFAULT_RULES

  config.lock()
  return config
