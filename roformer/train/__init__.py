"""Training: the optimizer, the jitted step, the train state and the loop that drives a run.

Entry point: `train_and_evaluate(config, workdir)`.
"""

from roformer.train.loop import train_and_evaluate

__all__ = ["train_and_evaluate"]
