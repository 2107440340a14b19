"""Fine-tuning a Hugging Face decoder (Llama, Mistral, Qwen2, GPT-NeoX): its directory sets the
model, the tokenizer and train.init_from.

Run: python train.py --config=configs/hf_decoder.py:HF_DIR --workdir=DIR \
       --config.data.source=files --config.data.files='corpus/*.txt' --config.data.seq_len=4096
Context extension (PI / YaRN): add --config.posenc.scaling.kind=yarn (or linear)
--config.posenc.scaling.factor=2 and a data.seq_len twice the checkpoint's training length (its
max_position_embeddings, the scaling's original length when config.json has no scaling).

Every model.* and posenc.* field is read from HF_DIR/config.json as `roformer.hf.load_hf_decoder`
reads it; train.py refuses a run that changes one that changes the numbers (roformer/train/
init_from.py), except model.dtype, param_dtype, attention_impl, attention_block, dropout_rate,
remat and posenc.scaling. Data, optimizer and schedule are default.py's: set them for the fine-tune.
"""

import dataclasses
import os

from configs import default


def get_config(hf_dir: str = ""):
  if not hf_dir:
    raise ValueError(
      "configs/hf_decoder.py reads a Hugging Face directory: --config=configs/hf_decoder.py:HF_DIR"
    )
  from roformer import hf  # the config.json mapping of the importer, not a copy of it

  hf_dir = os.path.abspath(os.path.expanduser(hf_dir))
  checkpoint = hf.hf_decoder_config(hf.read_hf_config(hf_dir))
  model = {f.name: getattr(checkpoint, f.name) for f in dataclasses.fields(checkpoint)}
  tokenizer = os.path.join(hf_dir, "tokenizer.json")
  if not os.path.isfile(tokenizer):
    raise ValueError(
      f"{hf_dir} has no tokenizer.json: a fine-tune reads its text with the checkpoint's own "
      "tokenizer (save it with the model's tokenizer.save_pretrained)"
    )
  posenc = model.pop("posenc").to_dict()  # every posenc field, the encodings' own included
  del model["vocab_size"]  # the checkpoint's, set by the training loop
  config = default.get_config()
  config.model.update(model)
  config.posenc.scaling.update(posenc.pop("scaling"))
  config.posenc.extension.update(posenc.pop("extension"))
  config.posenc.update(posenc)
  config.data.tokenizer = tokenizer
  config.train.init_from = hf_dir
  return config
