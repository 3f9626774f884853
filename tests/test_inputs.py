"""verispec.inputs.is_int: the one integer test — an int, never a bool; NumPy's integers only when asked;
check_int, the one check of an integer in a range and its one wording."""

from __future__ import annotations

import numpy as np
import pytest

from verispec.errors import UsageError
from verispec.inputs import check_int, is_int


def test_is_int_refuses_bools_and_non_integers():
    assert is_int(0) and is_int(-3) and is_int(2**70)
    assert not any(is_int(x) for x in (True, False, 1.0, "1", None, np.int64(1)))
    assert is_int(np.int64(1), integral=True) and is_int(7, integral=True)
    assert not any(is_int(x, integral=True) for x in (True, np.bool_(True), 1.0, np.float64(1)))


def test_check_int_returns_the_value_or_says_the_range_in_one_wording():
    assert (
        check_int(3, "k", 0) == 3
        and check_int(5, "n", 1, 5) == 5
        and check_int(np.int64(2), "x", integral=True) == 2
    )
    for value, low, high, message in (
        (0, 1, None, "slots must be an integer >= 1, got 0"),
        (True, 0, None, "slots must be an integer >= 0, got True"),
        (2.0, 0, None, "slots must be an integer >= 0, got 2.0"),
        (6, 1, 5, "slots must be an integer in [1, 5], got 6"),
        (np.int64(2), 0, None, "slots must be an integer >= 0, got np.int64(2)"),  # not without integral
    ):
        with pytest.raises(UsageError) as refused:
            check_int(value, "slots", low, high)
        assert str(refused.value) == message
    with pytest.raises(UsageError, match=r"^top_k must be an integer >= 0 \(0 disables it\), got -1$"):
        check_int(-1, "top_k", 0, hint=" (0 disables it)")
