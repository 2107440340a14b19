"""What a run needs from the machine, knowing no model and no run config: the device mesh and
shardings, checkpoint I/O, preemption, the workdir and its lock, the metrics log, batch
prefetching, the XLA:CPU flags and the persistent compilation cache (imported before JAX, so
this package imports nothing)."""
