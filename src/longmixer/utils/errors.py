"""Errors whose message is the whole story (what is wrong and the command that fixes it), and which errors of a
constructor are refusals of a setting rather than bugs."""

from __future__ import annotations

import dis
from pathlib import Path

_RAISE = dis.opmap["RAISE_VARARGS"]
_PACKAGE = Path(__file__).resolve().parents[1]  # src/longmixer


class UserFacingError(Exception):
    """An error a user fixes by running a command or changing a setting; the entry points print its message as one
    line and exit 2 instead of a traceback (inside a sweep it is raised, so the sweep records the failed job)."""


class TrainingDivergedError(UserFacingError, FloatingPointError):
    """The training loss became non-finite: the user's fix is a setting (learning rate, warmup, clipping,
    precision), so it is reported in one line with those fixes, not as a traceback."""


def raised_by_a_check(err: BaseException) -> bool:
    """Whether `err` (a ValueError or TypeError met while building an object from the config) comes from a check of
    an argument, which the entry points report as a refused setting: a `raise` statement in a constructor's own frame
    (`__init__`, `__post_init__`: the class refusing a value it was given, as torch's `Dropout(p=2)` does) or in
    longmixer's code (whose ValueErrors are its checks of user input, some in helpers the constructors call). An
    error of the interpreter or a builtin (an unpacking, `int("x")`, `math.log(0)`) or of a library function that is
    no constructor (`torch.nn.init` given a tensor of the wrong rank) is a bug, whose traceback matters: the innermost
    frame's instruction tells the two apart, whatever the message says."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    code = tb.tb_frame.f_code
    if not 0 <= tb.tb_lasti < len(code.co_code) or code.co_code[tb.tb_lasti] != _RAISE:
        return False
    return code.co_name in ("__init__", "__post_init__") or Path(code.co_filename).resolve().is_relative_to(_PACKAGE)
