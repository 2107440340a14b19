"""benchmarks/hf_counterpart.py (throughput.py --compare_hf): the Hugging Face decoder is the
same model as ours.

Needs torch and transformers (not project dependencies): skipped without them, as in CI.
"""

import sys

import numpy as np
import pytest

from roformer.testing import REPO

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from benchmarks import bench_step, hf_counterpart  # noqa: E402
from configs import lm  # noqa: E402

# The speed issue's decoder: Llama-style, bytes vocabulary, 512 tokens.
LLAMA = {
  "model.num_layers": 4,
  "model.emb_dim": 256,
  "model.num_heads": 4,
  "model.mlp_dim": 704,
  "model.activation": "swiglu",
  "model.norm": "rmsnorm",
  "model.use_bias": False,
  "model.tie_embeddings": False,
  "posenc.rope_layout": "half",
  "data.seq_len": 512,
  "train.global_batch_size": 8,
}
# The same shape with the default decoder block (GELU MLP 1024, LayerNorm, biases, tied head).
NEOX = {**{k: LLAMA[k] for k in ("model.num_layers", "model.emb_dim", "model.num_heads")},
        "model.mlp_dim": 1024, "posenc.rope_layout": "half", "data.seq_len": 512}  # fmt: skip
TINY = {"model.num_layers": 2, "model.emb_dim": 32, "model.num_heads": 2, "data.seq_len": 32,
        "train.global_batch_size": 2}  # fmt: skip


def _run_config(overrides):
  config = lm.get_config()
  bench_step.apply_overrides(config, overrides)
  return bench_step.run_config(config)


def _ours(run_config, seed=0):
  from flax import nnx

  from roformer.nn import model as model_lib

  return model_lib.make_model(run_config.model, rngs=nnx.Rngs(seed))


def _hf(counterpart):
  torch.manual_seed(0)
  return getattr(transformers, counterpart.name)(counterpart.config).eval()


@pytest.mark.parametrize(
  "overrides, name",
  [(LLAMA, "LlamaForCausalLM"), (NEOX, "GPTNeoXForCausalLM")],
  ids=["llama", "neox"],
)
def test_hf_decoder_of_the_issue_shape_has_our_parameter_count(overrides, name):
  import jax
  from flax import nnx

  run_config = _run_config(overrides)
  counterpart = hf_counterpart.hf_counterpart(run_config)
  assert (counterpart.name, counterpart.note) == (name, "")
  abstract = nnx.eval_shape(lambda: _ours(run_config))
  params = jax.tree.leaves(nnx.state(abstract, nnx.Param))
  ours = sum(int(np.prod(x.shape)) for x in params)
  hf = sum(p.numel() for p in _hf(counterpart).parameters())  # a tied head counts once
  assert ours == hf


def _t(x):
  return torch.from_numpy(np.array(x, np.float32))


def _copy_llama(ours, hf):
  """Our Llama-style Decoder's parameters into LlamaForCausalLM (torch Linear: [out, in])."""
  sd = {"model.embed_tokens.weight": ours.embed.embedding[...],
        "model.norm.weight": ours.final_norm.scale[...],
        "lm_head.weight": ours.lm_head.kernel[...].T}  # fmt: skip
  for i, layer in enumerate(ours.layers):
    p, a = f"model.layers.{i}.", layer.attn
    for theirs, mine in (("q_proj", a.query), ("k_proj", a.key), ("v_proj", a.value)):
      kernel_DGK = mine.kernel[...]
      sd[p + f"self_attn.{theirs}.weight"] = kernel_DGK.reshape(kernel_DGK.shape[0], -1).T
    out_HKD = a.out.kernel[...]
    sd[p + "self_attn.o_proj.weight"] = out_HKD.reshape(-1, out_HKD.shape[-1]).T
    sd[p + "input_layernorm.weight"] = layer.attn_norm.scale[...]
    sd[p + "post_attention_layernorm.weight"] = layer.mlp_norm.scale[...]
    for name in ("gate", "up", "down"):
      sd[p + f"mlp.{name}_proj.weight"] = getattr(layer.mlp, name).kernel[...].T
  hf.load_state_dict({k: _t(v) for k, v in sd.items()}, strict=True)


def _copy_neox(ours, hf):
  """Our default Decoder's parameters into GPTNeoXForCausalLM (fused q/k/v per head)."""
  sd = {"gpt_neox.embed_in.weight": ours.embed.embedding[...],
        "gpt_neox.final_layer_norm.weight": ours.final_norm.scale[...],
        "gpt_neox.final_layer_norm.bias": ours.final_norm.bias[...]}  # fmt: skip
  for i, layer in enumerate(ours.layers):
    p, a = f"gpt_neox.layers.{i}.", layer.attn
    D, H, K = a.query.kernel.shape
    # NeoX's fused output rows run over (head, q/k/v, head dim).
    kernel_DH3K = np.stack([np.asarray(m.kernel[...]) for m in (a.query, a.key, a.value)], 2)
    bias_H3K = np.stack([np.asarray(m.bias[...]) for m in (a.query, a.key, a.value)], 1)
    sd[p + "attention.query_key_value.weight"] = kernel_DH3K.reshape(D, -1).T
    sd[p + "attention.query_key_value.bias"] = bias_H3K.reshape(-1)
    sd[p + "attention.dense.weight"] = a.out.kernel[...].reshape(H * K, D).T
    sd[p + "attention.dense.bias"] = a.out.bias[...]
    for theirs, norm in (("input_layernorm", layer.attn_norm), ("post_attention_layernorm",
                                                                 layer.mlp_norm)):  # fmt: skip
      sd[p + f"{theirs}.weight"], sd[p + f"{theirs}.bias"] = norm.scale[...], norm.bias[...]
    for theirs, mine in (("dense_h_to_4h", layer.mlp.up), ("dense_4h_to_h", layer.mlp.down)):
      sd[p + f"mlp.{theirs}.weight"], sd[p + f"mlp.{theirs}.bias"] = (
        mine.kernel[...].T,
        mine.bias[...],
      )
  missing, unexpected = hf.load_state_dict({k: _t(v) for k, v in sd.items()}, strict=False)
  assert len(missing) == 1 and not unexpected  # the output layer, tied to embed_in
  assert hf.get_output_embeddings().weight is hf.get_input_embeddings().weight


@pytest.mark.parametrize(
  "overrides, copy",
  [
    ({**LLAMA, **TINY, "model.mlp_dim": 88}, _copy_llama),
    ({**NEOX, **TINY}, _copy_neox),
    ({**NEOX, **TINY, "model.parallel_residual": True}, _copy_neox),
  ],
  ids=["llama", "neox", "neox_parallel_residual"],
)
def test_hf_decoder_loss_at_step_0_equals_ours_with_the_same_weights(overrides, copy):
  from roformer.train import step as step_lib

  run_config = _run_config(overrides)
  ours = _ours(run_config)
  hf = _hf(hf_counterpart.hf_counterpart(run_config))
  copy(ours, hf)
  batch = bench_step.synthetic_batch(run_config, np.random.default_rng(0))
  batch["weights"][:, -1] = 0  # HF shifts the labels: no target after the last token
  sums = step_lib.loss_sums(ours, batch, deterministic=True, rngs=None)
  ours_loss = float(sums["loss_sum"] / sums["weight_sum"])
  inputs = torch.from_numpy(batch["inputs"]).long()
  with torch.no_grad():
    hf_loss = hf(input_ids=inputs, labels=inputs).loss.item()
  assert abs(ours_loss - hf_loss) < 1e-5, (ours_loss, hf_loss)
  assert abs(ours_loss - np.log(run_config.model.vocab_size)) < 0.5  # a fresh model, not NaN


def test_decoder_neither_family_reproduces_is_refused_naming_the_field():
  run_config = _run_config({**TINY, "model.activation": "swiglu"})  # SwiGLU with LayerNorm
  with pytest.raises(hf_counterpart.NoCounterpartError, match=r"model\.norm='rmsnorm'"):
    hf_counterpart.hf_counterpart(run_config)


def test_llama_shaped_decoder_with_qkv_biases_alone_is_refused_naming_the_field():
  run_config = _run_config({**LLAMA, **TINY, "model.use_bias": False, "model.qkv_bias": True})
  with pytest.raises(hf_counterpart.NoCounterpartError, match=r"model\.qkv_bias=False"):
    hf_counterpart.hf_counterpart(run_config)


@pytest.mark.parametrize(
  "args, setup",
  [
    ((), "a process each; ours with malloc keeping freed memory, HF with glibc's default malloc"),
    (("--keep_freed_memory=false",), "a process each, both with glibc's default malloc"),
    (("--in_process",), "one process, both with glibc's default malloc"),
  ],
  ids=["as-shipped", "same-setting", "in-process"],
)
def test_compare_hf_times_both_sides_in_turn_under_the_named_setup(tmp_path, args, setup):
  import json
  import os
  import subprocess

  out = tmp_path / "throughput.json"
  cmd = [sys.executable, "-m", "benchmarks.throughput", "--smoke", "--compare_hf",
         f"--json={out}", *args]  # fmt: skip
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  result = json.loads(out.read_text())
  assert result["setup"] == setup and result["hf_model"] == "RoFormerForMaskedLM"
  # JAX_PLATFORMS=cpu: --hf_device=auto keeps torch on the CPU too, and the table says so.
  assert result["hf_precision"] == "cpu, float32"
  assert "| HF PyTorch tokens/s (cpu, float32) |" in proc.stdout
  # The setup is what the sides' processes report: their pids and malloc settings.
  assert len(result["tokens_per_sec_runs"]) == len(result["hf_tokens_per_sec_runs"]) == 2
  assert result["hf_tokens_per_sec"] > 0 and "| ours / HF " in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal on a machine without CUDA")
@pytest.mark.parametrize("script", ["throughput", "eval_speed"])
def test_hf_device_cuda_without_a_gpu_is_one_line_and_exit_1(script):
  import os
  import subprocess

  cmd = [sys.executable, "-m", f"benchmarks.{script}", "--smoke", "--compare_hf",
         "--hf_device=cuda"]  # fmt: skip
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1] == (
    f"{script}.py: error: --hf_device=cuda: torch sees no CUDA device (torch.cuda.is_available())"
  )


def test_eval_speed_compare_hf_scores_both_sides_on_the_cpu(tmp_path):
  import json
  import os
  import subprocess

  out = tmp_path / "eval_speed.json"
  cmd = [sys.executable, "-m", "benchmarks.eval_speed", "--smoke", "--compare_hf",
         "--config.model.activation=swiglu", "--config.model.norm=rmsnorm",
         "--config.model.use_bias=False", "--config.model.tie_embeddings=False",
         "--config.posenc.rope_layout=half", f"--json={out}"]  # fmt: skip
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  result = json.loads(out.read_text())
  assert result["hf_setup"] == "cpu, float32, torch.no_grad()"
  assert [row["length"] for row in result["rows"]] == [64, 256]
  assert all(row["hf_tokens_per_sec"] > 0 for row in result["rows"])
