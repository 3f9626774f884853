"""verispec.inputs.is_int: the one integer test — an int, never a bool; NumPy's integers only when asked."""

from __future__ import annotations

import numpy as np

from verispec.inputs import is_int


def test_is_int_refuses_bools_and_non_integers():
    assert is_int(0) and is_int(-3) and is_int(2**70)
    assert not any(is_int(x) for x in (True, False, 1.0, "1", None, np.int64(1)))
    assert is_int(np.int64(1), integral=True) and is_int(7, integral=True)
    assert not any(is_int(x, integral=True) for x in (True, np.bool_(True), 1.0, np.float64(1)))
