"""The op backends a config may name (`ops.backend`). A module of its own, importing nothing, so that the ops layer
reads it without the config stack (omegaconf is absent on machines that only run kernels)."""

BACKENDS = ("auto", "torch", "triton")
