"""Tests of the metrics writers: metrics.jsonl, TensorBoard events and the console lines."""

import errno
import json
import logging
import os
import re

import pytest

from roformer.errors import StorageFullError
from roformer.infra import metrics_log
from roformer.testing import REPO


def test_console_prints_progress_after_1_2_4_8_steps_until_the_first_regular_line():
  console = metrics_log.ConsoleLog(1000, log_every_steps=100)
  console.start(0)
  wanted = [s for s in range(1, 300) if console.wants_progress(s)]
  assert wanted == [1, 2, 4, 8, 16, 32, 64]


def test_console_progress_counts_from_the_resumed_step():
  console = metrics_log.ConsoleLog(1000, log_every_steps=100)
  console.start(250)
  assert [s for s in range(251, 400) if console.wants_progress(s)] == [251, 252, 254, 258, 266, 282]


def test_console_prints_progress_when_a_regular_line_is_long_overdue(monkeypatch):
  now = [0.0]
  monkeypatch.setattr(metrics_log.time, "perf_counter", lambda: now[0])
  console = metrics_log.ConsoleLog(10_000, log_every_steps=5000)
  console.start(0)
  assert not console.wants_progress(3)
  now[0] = console.PROGRESS_SECONDS + 1.0
  assert console.wants_progress(3)
  console.progress(3, {"train_loss": 2.5})
  assert not console.wants_progress(5)  # a line was just printed


def test_console_progress_line_shows_loss_rate_and_time_left(monkeypatch):
  now = [0.0]
  lines = []
  monkeypatch.setattr(metrics_log.time, "perf_counter", lambda: now[0])
  monkeypatch.setattr(metrics_log.logging, "info", lambda text: lines.append(text))
  console = metrics_log.ConsoleLog(101, log_every_steps=100)
  console.start(0)
  now[0] = 2.0
  console.progress(1, {"train_loss": 5.25})
  assert lines == ["step 1/101, train_loss 5.2500, 2.00s/step, 3m20s left"]


def test_metrics_writer_events_are_read_by_the_pinned_tensorboard(tmp_path):
  pins = (REPO / "requirements-dev.txt").read_text()
  assert re.search(r"^tensorboard==\d+\.\d+\.\d+", pins, re.M), "tensorboard is not pinned"
  assert re.search(r"^-c requirements.txt", pins, re.M), "dev installs may move runtime pins"
  from tensorboard.backend.event_processing import event_accumulator

  writer = metrics_log.MetricsWriter(tmp_path, enabled=True)
  writer.write(10, {"train_loss": 2.5})
  writer.write(20, {"train_loss": 2.0})
  writer.close()
  events = event_accumulator.EventAccumulator(str(tmp_path))
  events.Reload()
  assert [(e.step, e.value) for e in events.Scalars("train_loss")] == [(10, 2.5), (20, 2.0)]
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert records == [{"step": 10, "train_loss": 2.5}, {"step": 20, "train_loss": 2.0}]


WHOLE = b'{"step": 1, "train_loss": 3.0}\n{"step": 2, "train_loss": 2.5}\n'


@pytest.mark.parametrize(
  "tail", [b'{"step": 2.5, "train_lo', b"\x00" * 40 + b"\n"], ids=["cut_json", "zero_bytes"]
)
def test_metrics_writer_drops_an_unfinished_last_line_before_appending(tmp_path, caplog, tail):
  (tmp_path / "metrics.jsonl").write_bytes(WHOLE + tail)
  with caplog.at_level(logging.WARNING):
    writer = metrics_log.MetricsWriter(tmp_path, enabled=True)
  writer.write(3, {"train_loss": 2.0})
  writer.close()
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
  (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  assert "metrics.jsonl" in warning and f"dropped {len(tail)} bytes" in warning


@pytest.mark.parametrize("tail", [b"", b'{"step": 3, "train_loss": 2.0}'], ids=["whole", "no_eol"])
def test_metrics_writer_keeps_every_whole_record(tmp_path, caplog, tail):
  (tmp_path / "metrics.jsonl").write_bytes(WHOLE + tail)
  with caplog.at_level(logging.WARNING):
    metrics_log.MetricsWriter(tmp_path, enabled=True).close()
  assert (tmp_path / "metrics.jsonl").read_bytes() == WHOLE + tail + (b"\n" if tail else b"")
  assert not caplog.records


def test_metrics_writer_reports_a_full_disk_in_one_line(tmp_path, monkeypatch):
  writer = metrics_log.MetricsWriter(tmp_path, enabled=True)

  def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(type(writer._path), "open", full)
  with pytest.raises(StorageFullError) as error:
    writer.write(1, {"train_loss": 2.0})
  writer.close()
  assert "\n" not in str(error.value) and "the disk is full" in str(error.value)
