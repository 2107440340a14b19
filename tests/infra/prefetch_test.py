"""roformer/infra/prefetch.py: batches in order, errors at their step, early stop."""

import pytest

from roformer.infra import prefetch


def test_prefetcher_yields_every_step_in_order():
  with prefetch.Prefetcher(lambda step: step * 10, range(3, 9), depth=2) as batches:
    assert list(batches) == [(s, s * 10) for s in range(3, 9)]


def test_prefetcher_raises_the_error_at_the_failing_step():
  def make(step):
    if step == 2:
      raise ValueError("bad step 2")
    return step

  with prefetch.Prefetcher(make, range(5)) as batches:
    assert next(batches) == (0, 0) and next(batches) == (1, 1)
    with pytest.raises(ValueError, match="bad step 2"):
      next(batches)


def test_prefetcher_stops_its_thread_when_left_early():
  made = []
  with prefetch.Prefetcher(lambda step: made.append(step) or step, range(1000), depth=2) as it:
    next(it)
  assert not it._thread.is_alive()
  assert len(made) <= 4  # the consumed one, the queue's two, one blocked on a full queue
