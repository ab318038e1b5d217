"""tests/_pairwise.py: the interpreter sweeps' all-pairs cases cover every pair of values, with stable ids."""

from itertools import combinations, product

import pytest

from tests._pairwise import all_pairs


def test_every_pair_of_values_meets_in_some_case():
    axes = [[pytest.param(i, 10 * i, id=f"path{i}") for i in range(4)], ["softmax", "relu2", "laplace"],
            [pytest.param(False, id="bidir"), pytest.param(True, id="causal")], [1, 2, 3]]
    cases = all_pairs(*axes)
    assert len(cases) < 4 * 3 * 2 * 3
    rows = [case.values for case in cases]
    assert all(len(r) == 5 and r[1] == 10 * r[0] for r in rows)  # a two-argument value keeps its arguments together
    values = [range(4), ["softmax", "relu2", "laplace"], [False, True], [1, 2, 3]]
    columns = [0, 2, 3, 4]  # where each axis's value sits in a case's arguments
    for i, j in combinations(range(4), 2):
        for va, vb in product(values[i], values[j]):
            assert any(r[columns[i]] == va and r[columns[j]] == vb for r in rows), (i, j, va, vb)
    assert {r[2] for r in rows} == {"softmax", "relu2", "laplace"} and {r[4] for r in rows} == {1, 2, 3}
    assert cases[0].id == "path0-softmax-bidir-1"
    assert [c.id for c in cases] == [c.id for c in all_pairs(*axes)]  # the same cases on every call (xdist)
    assert len({c.id for c in cases}) == len(cases)


def test_a_single_axis_is_its_values_and_an_empty_axis_is_refused():
    assert [c.values for c in all_pairs([1, 2, 3])] == [(1,), (2,), (3,)]
    assert [c.values for c in all_pairs([7], ["a"])] == [(7, "a")]
    with pytest.raises(ValueError, match="every axis needs at least one value"):
        all_pairs([1], [])
