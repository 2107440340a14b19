"""--hf_device (throughput.py, eval_speed.py): where the Hugging Face side runs, decided without
starting JAX or needing a GPU."""

import pytest

from benchmarks import hf_counterpart


@pytest.mark.parametrize(
  "requested, cuda, platforms, device",
  [
    ("auto", True, "", "cuda"),  # JAX free to take the GPU: both sides on it
    ("auto", True, "cuda", "cuda"),
    ("auto", True, "gpu,cpu", "cuda"),
    ("auto", True, "cpu", "cpu"),  # JAX held to the CPU (the tests): so is torch
    ("auto", False, "", "cpu"),
    ("cpu", True, "", "cpu"),
    ("cuda", True, "cpu", "cuda"),  # named: as asked
  ],
)
def test_hf_device_follows_jax_unless_named(requested, cuda, platforms, device):
  got = hf_counterpart.resolve_device(requested, cuda_available=cuda, jax_platforms=platforms)
  assert got == device


def test_cuda_torch_cannot_see_is_refused():
  with pytest.raises(ValueError, match=r"--hf_device=cuda: torch sees no CUDA device"):
    hf_counterpart.resolve_device("cuda", cuda_available=False, jax_platforms="")


@pytest.mark.parametrize("device, preallocate", [("cuda", "false"), ("cpu", None)])
def test_jax_stops_preallocating_only_beside_torch_on_the_gpu(monkeypatch, device, preallocate):
  monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
  hf_counterpart.share_gpu_with_torch(device)
  import os

  assert os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE") == preallocate
