"""Attention: the kinds a model chooses from (kinds.py), the softmax layer and its kernels, banded
windows, linear attention, multi-head latent attention and the decoding caches."""
