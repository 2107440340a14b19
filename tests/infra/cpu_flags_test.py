"""roformer/infra/cpu_flags.py: default XLA:CPU flags only on CPU, only when the user set none."""

import os

import pytest

from roformer.infra import cpu_flags


@pytest.mark.parametrize(
  "env, expected",
  [
    ({"JAX_PLATFORMS": "cpu"}, cpu_flags.CPU_XLA_FLAGS),
    ({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_dump_to=/tmp/x"}, "--xla_dump_to=/tmp/x"),
    ({"JAX_PLATFORMS": "tpu"}, None),
    ({"JAX_PLATFORMS": "cuda,cpu"}, None),
  ],
)
def test_cpu_flags_set_only_on_cpu_without_user_flags(monkeypatch, env, expected):
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  assert cpu_flags.set_default_cpu_flags() == (
    expected == cpu_flags.CPU_XLA_FLAGS and "XLA_FLAGS" not in env
  )
  assert os.environ.get("XLA_FLAGS") == expected
