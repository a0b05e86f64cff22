"""largest: the integer search every sizer shares, against a linear scan."""

import doctest

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvforge.core import search
from kvforge.core.search import largest


@given(answer=st.integers(0, 5_000), lo=st.integers(0, 5_000), bounded=st.booleans())
def test_largest_is_the_last_value_that_fits(answer, lo, bounded):
    lo = min(lo, answer)
    calls = []

    def fits(x):
        calls.append(x)
        return x <= answer

    hi = answer + 17 if bounded else None
    assert largest(fits, lo, hi) == answer
    assert all(x >= lo for x in calls)
    if hi is not None:
        assert all(x <= hi for x in calls)


@pytest.mark.parametrize("hi", [0, 3, 10])
def test_a_bound_caps_the_answer(hi):
    assert largest(lambda x: True, 0, hi) == hi


def test_the_docstring_examples_run():
    assert doctest.testmod(search).failed == 0
