# SPDX-License-Identifier: Apache-2.0
"""Arbitrary integers in every field of a job and a promotion on each CUDA backend
(`tests/test_tier_refusals.py` runs the host's): every backend checks through the same
`EngineBase.prepare` and the actor's and the file tier's checks, and this runs each one's copy
after them -- no write outside the region, no row a job does not name changed, no raw
exception."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_group
from tests.test_tier_refusals import _fuzz

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("backend", ["triton", "hybrid", "copy_engine", "per_block"])
def test_arbitrary_integers_in_every_field_never_write_outside_the_region_on_cuda(
        backend: str, tmp_path) -> None:
    out = run_group(_fuzz, 1, args=(str(tmp_path), 150, backend), timeout=600, pg_timeout=120)
    error = out[0].error or ""
    if "needs triton" in error or "CUDA 13 driver" in error:
        pytest.skip(error.splitlines()[0])
    assert out[0].ok, error
    seen, _, engine = out[0].value
    assert engine == backend
    assert all(seen.values()), seen
