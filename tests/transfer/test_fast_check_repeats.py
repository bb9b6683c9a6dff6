"""Repeated destinations are refused by the native check on both packing widths: the int32
staging slots the kernel uploads and the int64 arrays of the other engines (the repeat check is
written once per width in job_check.c, so each needs its own case)."""

from __future__ import annotations

import numpy as np
import pytest

from offload.transfer.fast_check import checker_library
from tests.transfer.test_fast_check import checker

pytestmark = pytest.mark.skipif(checker_library() is None,
                                reason="needs a C compiler and Python.h")

REPEATS = {  # direction -> a job whose destinations repeat (GPU block 1 / host page 9)
    "load": ([1, 2, 1], [0, 0, 0], [0, 1, 2]),
    "store": ([1, 2, 3], [2, 1, 2], [1, 0, 1]),
}


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("direction", ["load", "store"])
def test_a_repeat_packed_into_a_staging_target_is_refused(direction: str, dtype: type) -> None:
    staging = np.full(16, -1, dtype=dtype)
    check = checker()
    unique = ([7, 8, 9], [0, 1, 2], [0, 1, 2])
    assert check.check(direction, *unique, lambda n: (staging, None)) is not None
    assert check.check(direction, *REPEATS[direction], lambda n: (staging, None)) is None
