"""Ops tests fill `torch.empty` with NaN (as FLA's tests do), so a kernel that leaves part of its output unwritten
fails instead of passing on leftover memory."""

import pytest
import torch

_empty, _empty_like = torch.empty, torch.empty_like


def _nan_empty(*args, **kwargs):
    out = _empty(*args, **kwargs)
    if out.is_floating_point():
        out.fill_(float("nan"))
    return out


def _nan_empty_like(*args, **kwargs):
    out = _empty_like(*args, **kwargs)
    if out.is_floating_point():
        out.fill_(float("nan"))
    return out


@pytest.fixture(autouse=True)
def nan_filled_empty(monkeypatch):
    monkeypatch.setattr(torch, "empty", _nan_empty)
    monkeypatch.setattr(torch, "empty_like", _nan_empty_like)
    yield
