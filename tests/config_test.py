"""Tests of the config boundary: configs/*.py, validation, config.json and the resume rule."""

import dataclasses
import importlib
import json
import re
import typing

import pytest

from configs import default
from roformer import config as config_lib
from roformer import posenc
from roformer.config import ConfigError
from roformer.data.config import DataConfig
from roformer.fields import field_doc
from roformer.nn.config import ModelConfig
from roformer.posenc.config import ContextExtension, PosEncConfig, RopeScaling


def _config_dict(**overrides):
  config = default.get_config()
  for name, value in overrides.items():
    group, _, field = name.replace("__", ".").rpartition(".")
    node = config
    for part in group.split("."):
      node = node[part]
    node[field] = value
  return config


GROUP_CLASSES = {
  "model": ModelConfig,
  "data": DataConfig,
  "optim": config_lib.OptimConfig,
  "train": config_lib.TrainConfig,
  "mesh": config_lib.MeshConfig,
}


@pytest.mark.parametrize("group, cls", GROUP_CLASSES.items())
def test_every_config_field_is_declared_with_a_doc_and_a_default_of_its_type(group, cls):
  # The declaration is the field's one home: configs/default.py's group and the reference page
  # are read from it. A ConfigDict field takes the type of its default, so a default of another
  # type (an int for a float, None) would make the field refuse or misread command-line values.
  hints = typing.get_type_hints(cls)
  for f in dataclasses.fields(cls):
    assert field_doc(f).strip(), f"{group}.{f.name} has no doc: declare it with param(default, doc)"
    assert type(f.default) is hints[f.name], f"{group}.{f.name}: default {f.default!r}"


def test_configs_default_builds_the_dataclasses_defaults():
  # configs/default.py's run is the dataclasses built with no arguments (the encoding's
  # run-dependent defaults resolved), and the vocabulary size is no field of a config file.
  config = default.get_config()
  assert "vocab_size" not in config.model and "posenc" not in config.model
  run = config_lib.run_config_from_dict(config)
  assert run.model == dataclasses.replace(ModelConfig(), posenc=run.model.posenc)
  for group in ("data", "optim", "train", "mesh"):
    assert getattr(run, group) == GROUP_CLASSES[group](), group


def test_config_reference_shows_each_fields_declared_doc():
  from configs import reference

  rows = {
    line.split(" | ")[0].strip("| `"): line
    for line in reference.markdown().splitlines()
    if line.startswith("| `")
  }
  for group in GROUP_CLASSES:
    for f in config_lib.group_fields(group):
      row = rows[f"{group}.{f.name}"]
      assert row.endswith(f" | {reference._cell(field_doc(f))} |"), row


@pytest.mark.parametrize(
  "name", ["default", "lm", "mlm", "quickstart", "irope", "rnope_swa", "fox"]
)
def test_config_files_are_locked_and_valid(name):
  config = importlib.import_module(f"configs.{name}").get_config()
  with pytest.raises(AttributeError):
    config.model.num_layerz = 3
  run_config = config_lib.run_config_from_dict(config)
  assert run_config.model.posenc.scaling.original_max_len == run_config.data.seq_len


def test_mlm_config_is_post_ln_encoder():
  from configs import mlm

  run_config = config_lib.run_config_from_dict(mlm.get_config())
  assert run_config.model.kind == "encoder" and not run_config.model.pre_norm


def test_summary_is_one_line_of_size_encoding_data_and_budget():
  from configs import arms, quickstart

  run_config = config_lib.run_config_from_dict(quickstart.get_config(), vocab_size=261)
  assert config_lib.summary(run_config, num_params=1_834_752) == (
    "decoder, 4 layers x 192 wide, 4 heads, 1,834,752 parameters; encoding rope; data "
    "pystdlib, tokenizer bytes (vocab 261), seq_len 128; 700 steps of 16 sequences, learning "
    "rate 0.0015 (cosine)"
  )
  # A hybrid names its layers' encodings; a RoPE scaling its kind and factor.
  config = quickstart.get_config()
  arms.apply(config, "irope", nope_every=2)
  config.posenc.scaling.kind, config.posenc.scaling.factor = "yarn", 4.0
  line = config_lib.summary(config_lib.run_config_from_dict(config), num_params=1)
  assert "; encoding rope/nope by layer (yarn x4); " in line and "\n" not in line


def test_run_config_resolves_original_max_len_only_when_zero():
  config = _config_dict(**{"data.seq_len": 128, "posenc.scaling.kind": "yarn"})
  assert config_lib.run_config_from_dict(config).model.posenc.scaling.original_max_len == 128
  config.posenc.scaling.original_max_len = 64
  assert config_lib.run_config_from_dict(config).model.posenc.scaling.original_max_len == 64


def test_run_config_vocab_size_comes_from_argument():
  run_config = config_lib.run_config_from_dict(default.get_config(), vocab_size=1234)
  assert run_config.model.vocab_size == 1234


def test_run_config_rejects_unknown_field_naming_it():
  values = config_lib.to_dict(config_lib.run_config_from_dict(default.get_config()))
  values["train"]["num_train_stepz"] = 5
  with pytest.raises(ConfigError, match=r"train\.num_train_stepz"):
    config_lib.run_config_from_dict(values)


@pytest.mark.parametrize(
  "overrides, field",
  [
    ({"posenc.kind": "rotary"}, "posenc.kind"),
    ({"posenc.kind": "learned", "posenc.max_len": 256, "data.seq_len": 512}, "posenc.max_len"),
    ({"model.num_heads": 8, "model.num_kv_heads": 3}, "model.num_kv_heads"),
    ({"model.kind": "encoder", "posenc.kind": "xpos"}, "xpos"),
    ({"model.emb_dim": 120, "model.num_heads": 8}, "head_dim"),
    ({"model.kind": "transformer"}, "model.kind"),
    ({"posenc.scaling.kind": "magic"}, "posenc.scaling.kind"),
    ({"optim.schedule": "exponential"}, "optim.schedule"),
    ({"optim.grad_accum_steps": 3}, "optim.grad_accum_steps"),
    ({"train.log_every_steps": 0}, "train.log_every_steps"),
    ({"mesh.data": 0}, "mesh.data"),
    ({"mesh.data": -1, "mesh.fsdp": -1}, "mesh"),
    ({"mesh.rules": (("batch", "pipeline"),)}, "mesh.rules"),
    ({"data.source": "web"}, "data.source"),
    ({"data.seq_len": 0}, "data.seq_len"),
    ({"optim.learning_rate": 0.0}, "optim.learning_rate must be > 0"),
    ({"train.num_train_steps": 0}, "train.num_train_steps must be >= 1"),
  ],
)
def test_run_config_rejects_bad_value_naming_field(overrides, field):
  with pytest.raises(ConfigError, match=re.escape(field)):
    config_lib.run_config_from_dict(_config_dict(**overrides))


def test_run_config_rejects_wrong_type_naming_field():
  values = config_lib.to_dict(config_lib.run_config_from_dict(default.get_config()))
  values["model"]["num_layers"] = "6"
  with pytest.raises(ConfigError, match=r"model\.num_layers must be an integer"):
    config_lib.run_config_from_dict(values)


def test_config_json_round_trips(tmp_path):
  run_config = config_lib.run_config_from_dict(default.get_config(), vocab_size=300)
  config_lib.write_config_json(tmp_path, run_config)
  assert config_lib.load_run_config(tmp_path) == run_config
  assert config_lib.load_run_config(tmp_path).mesh.rules == run_config.mesh.rules


def test_load_run_config_without_config_json_raises(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json"):
    config_lib.load_run_config(tmp_path)


def test_load_run_config_of_a_missing_workdir_says_it_does_not_exist(tmp_path):
  with pytest.raises(FileNotFoundError, match=f"the workdir {tmp_path / 'nope'} does not exist"):
    config_lib.load_run_config(tmp_path / "nope")


def test_load_run_config_names_a_config_json_that_is_not_json(tmp_path):
  config_lib.write_config_json(tmp_path, config_lib.run_config_from_dict(default.get_config()))
  text = (tmp_path / "config.json").read_text()
  (tmp_path / "config.json").write_text(text[: len(text) // 2])  # a write cut short
  with pytest.raises(ValueError, match=f"{tmp_path / 'config.json'} is not valid JSON"):
    config_lib.load_run_config(tmp_path)


@pytest.mark.parametrize(
  "field, value",
  [
    ("optim.learning_rate", float("inf")),
    ("optim.learning_rate", float("nan")),
    ("optim.grad_clip_norm", float("inf")),
    ("model.dropout_rate", float("nan")),
    ("posenc.max_wavelength", float("inf")),
    ("posenc.scaling.factor", float("-inf")),
  ],
)
def test_run_config_rejects_a_non_finite_float_naming_the_field(field, value):
  with pytest.raises(ConfigError, match=f"^{re.escape(field)} must be a finite number, got"):
    config_lib.run_config_from_dict(_config_dict(**{field: value}))


def test_check_resume_allows_steps_and_frequencies():
  old = config_lib.to_dict(config_lib.run_config_from_dict(default.get_config(), vocab_size=259))
  new = config_lib.run_config_from_dict(
    _config_dict(
      **{
        "train.num_train_steps": 7,
        "train.log_every_steps": 3,
        "train.eval_every_steps": 5,
        "train.checkpoint_every_steps": 11,
      }
    )
  )
  config_lib.check_resume(old, new)


def test_check_resume_names_every_changed_field():
  old = config_lib.to_dict(config_lib.run_config_from_dict(default.get_config()))
  new = config_lib.run_config_from_dict(
    _config_dict(**{"optim.learning_rate": 1e-2, "posenc.kind": "alibi", "train.seed": 3})
  )
  with pytest.raises(ConfigError) as error:
    config_lib.check_resume(old, new)
  for field in ("optim.learning_rate", "posenc.kind", "train.seed"):
    assert field in str(error.value)
  assert "train.num_train_steps" in str(error.value)  # it says what may change


@pytest.mark.parametrize(
  "overrides, field, source",
  [
    ({"data.files": "corpus/*.txt"}, "data.files", "data.source='pystdlib'"),
    ({"data.validation_files": "v/*.txt"}, "data.validation_files", "data.source='pystdlib'"),
    ({"data.source": "files", "data.files": "a.txt", "data.hub_name": "x/y"}, "data.hub_name",
     "data.source='files'"),
    ({"data.streaming": True}, "data.streaming", "data.source='pystdlib'"),
  ],
)  # fmt: skip
def test_run_config_rejects_a_field_its_data_source_does_not_read(overrides, field, source):
  with pytest.raises(ConfigError) as error:
    config_lib.run_config_from_dict(_config_dict(**overrides))
  assert field in str(error.value) and source in str(error.value)


def test_run_config_rejects_an_unknown_text_encoding():
  with pytest.raises(ConfigError, match="data.text_encoding='utf-9'"):
    config_lib.run_config_from_dict(_config_dict(**{"data.text_encoding": "utf-9"}))


def test_check_resume_accepts_a_config_json_written_before_a_field_existed():
  old = config_lib.to_dict(config_lib.run_config_from_dict(default.get_config()))
  del old["data"]["text_encoding"]  # a field added later, whose default keeps the old behaviour
  config_lib.check_resume(old, config_lib.run_config_from_dict(default.get_config()))
  changed = config_lib.run_config_from_dict(_config_dict(**{"data.text_encoding": "latin-1"}))
  with pytest.raises(ConfigError, match="data.text_encoding"):
    config_lib.check_resume(old, changed)


def test_cope_npos_max_zero_becomes_the_training_length_plus_one():
  # CoPE's code: npos = block size + 1, so no position the training length reaches is clamped.
  config = default.get_config()
  config.posenc.kind = "cope"
  config.data.seq_len = 96
  assert config_lib.run_config_from_dict(config).model.posenc.cope_npos_max == 97
  config.posenc.cope_npos_max = 40
  assert config_lib.run_config_from_dict(config).model.posenc.cope_npos_max == 40


def test_a_run_written_before_per_layer_encodings_loads_as_shared(tmp_path):
  config = default.get_config()
  config.posenc.kind = "fire"
  config_lib.write_config_json(tmp_path, config_lib.run_config_from_dict(config))
  assert not config_lib.load_run_config(tmp_path).model.posenc.fire_shared
  path = tmp_path / config_lib.CONFIG_FILE
  values = json.loads(path.read_text())
  for field in ("fire_shared", "cope_shared"):
    del values["posenc"][field]
  path.write_text(json.dumps(values))
  posenc = config_lib.load_run_config(tmp_path).model.posenc
  assert posenc.fire_shared and posenc.cope_shared


def test_a_run_of_another_encoding_resumes_whatever_the_cope_and_fire_fields_say():
  # A config.json written before the CoPE/FIRE fields changed: a RoPE run's cope_npos_max=64
  # is a field of another encoding and cannot make the run another run.
  config = default.get_config()
  old = config_lib.to_dict(config_lib.run_config_from_dict(config))
  old["posenc"]["cope_npos_max"] = 64
  del old["posenc"]["fire_shared"]
  config_lib.check_resume(old, config_lib.run_config_from_dict(config))
  config.posenc.kind = "fire"  # but a FIRE run written then had one MLP for all layers
  old = config_lib.to_dict(config_lib.run_config_from_dict(config))
  del old["posenc"]["fire_shared"]
  with pytest.raises(ConfigError, match="posenc.fire_shared: True -> False"):
    config_lib.check_resume(old, config_lib.run_config_from_dict(config))


def test_default_posenc_group_is_every_declared_field_with_its_default():
  # The group is derived from the declarations: the posenc group's own fields, its two
  # sub-configs and every registered encoding's `Fields`, each at its declared default.
  group = default.get_config().posenc
  declared = {f.name: f.default for f in dataclasses.fields(PosEncConfig) if f.name != "own"}
  declared.update({n: f.default for n, f in posenc.encoding_fields().items()})
  scalars = {k: v for k, v in group.items() if not hasattr(v, "keys")}
  assert scalars == {k: v for k, v in declared.items() if k not in ("scaling", "extension")}
  for sub, cls in (("scaling", RopeScaling), ("extension", ContextExtension)):
    assert dict(group[sub]) == {f.name: f.default for f in dataclasses.fields(cls)}
  for kind in posenc.POSENCS:
    for name, f in posenc.fields_of(kind).items():
      assert f.metadata["doc"], f"posenc.{name} of {kind} has no doc"
      assert name in group


@pytest.mark.parametrize(
  "kind, field, value",
  [("fire", "fire_mlp_width", 16), ("t5", "t5_num_buckets", 8), ("xpos", "rope_layout", "half")],
)
def test_resume_rule_ignores_exactly_the_fields_no_used_encoding_declares(kind, field, value):
  # xpos inherits RoPE's fields, so rope_layout is its own too.
  config = _config_dict(**{"posenc.kind": kind})
  old = config_lib.to_dict(config_lib.run_config_from_dict(config))
  config.posenc[field] = value
  with pytest.raises(ConfigError, match=f"posenc.{field}"):
    config_lib.check_resume(old, config_lib.run_config_from_dict(config))
  other = _config_dict(**{"posenc.kind": "alibi"})
  old = config_lib.to_dict(config_lib.run_config_from_dict(other))
  other.posenc[field] = value
  config_lib.check_resume(old, config_lib.run_config_from_dict(other))


def test_resume_rule_reads_every_kind_of_a_layer_pattern():
  config = _config_dict(**{"posenc.kind": "rope", "posenc.layer_pattern": "rope,t5"})
  old = config_lib.to_dict(config_lib.run_config_from_dict(config))
  config.posenc.t5_num_buckets = 8
  with pytest.raises(ConfigError, match="posenc.t5_num_buckets"):
    config_lib.check_resume(old, config_lib.run_config_from_dict(config))
