"""Comparators shared by the op parity tests: one error measure and one named assertion, so every op reports a
mismatch the same way (which output, how large, against what scale)."""

from __future__ import annotations

import torch


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref||, in float64 (0-norm references count as 1e-30)."""
    return ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, *, atol: float = 0.0, rtol: float = 0.0,
                 min_scale: float = 0.0) -> None:
    """max |got - ref| <= atol + rtol * max(max |ref|, min_scale), reported under `name` (an output or gradient)."""
    err = (got.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    bound = atol + rtol * max(scale, min_scale)
    assert err <= bound, f"{name}: max abs error {err:.3e} > {bound:.3e} (ref scale {scale:.3e})"
