"""All-pairs parametrization for the interpreter sweeps: every value of each axis meets every value of every other
axis in at least one case, instead of the full cross product.

The kernels' paths (tilings, backward variants, tile modes) and their score functions (softmax, relu2, laplace;
causal or not) are mostly independent code: a defect lives in one path, one function, or one pair of them. A
covering array of strength 2 keeps every such pair and cuts a sweep of 4 x 3 x 3 cases to 12, which is what keeps
the Triton-interpreter suite inside CI's budget on two cores. The rows are chosen greedily from the cross product
in its order, so the cases and their ids are the same on every run and every xdist worker (xdist requires it)."""

from __future__ import annotations

from itertools import combinations, product

import pytest
from _pytest.mark.structures import ParameterSet


def _as_param(value) -> ParameterSet:
    return value if isinstance(value, ParameterSet) else pytest.param(value, id=str(value))


def all_pairs(*axes) -> list[ParameterSet]:
    """Cases covering every pair of values of two axes. An axis is a list of values or of `pytest.param`s (one
    holding several arguments counts as one value); a case's arguments are its values' arguments in axis order, and
    its id their ids joined by "-"."""
    axes = [[_as_param(v) for v in axis] for axis in axes]
    if any(not axis for axis in axes):
        raise ValueError("all_pairs: every axis needs at least one value")
    # each axis paired with itself too, so that one axis alone still gets every value
    pairs = [*combinations(range(len(axes)), 2), *((i, i) for i in range(len(axes)))]
    uncovered = {(i, a, j, b) for i, j in pairs for a in range(len(axes[i])) for b in range(len(axes[j]))
                 if i != j or a == b}
    rows = []
    candidates = list(product(*(range(len(axis)) for axis in axes)))
    while uncovered:
        row = max(candidates, key=lambda r: sum((i, r[i], j, r[j]) in uncovered for i, j in pairs))
        uncovered -= {(i, row[i], j, row[j]) for i, j in pairs}
        rows.append(row)
    cases = []
    for row in rows:
        chosen = [axis[index] for axis, index in zip(axes, row)]
        values = [v for p in chosen for v in p.values]
        ids = (p.id if p.id is not None else "-".join(map(str, p.values)) for p in chosen)
        cases.append(pytest.param(*values, id="-".join(ids)))
    return cases
