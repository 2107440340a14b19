"""RoFormer-JAX: a Flax NNX RoFormer with pluggable positional encodings."""
