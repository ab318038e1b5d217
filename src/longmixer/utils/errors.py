"""Errors whose message is the whole story (what is wrong and the command that fixes it)."""

from __future__ import annotations


class UserFacingError(Exception):
    """An error a user fixes by running a command or changing a setting; the entry points print its message as one
    line and exit 2 instead of a traceback (inside a sweep it is raised, so the sweep records the failed job)."""


class TrainingDivergedError(UserFacingError, FloatingPointError):
    """The training loss became non-finite: the user's fix is a setting (learning rate, warmup, clipping,
    precision), so it is reported in one line with those fixes, not as a traceback."""
