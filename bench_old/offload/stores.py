# SPDX-License-Identifier: Apache-2.0
"""Waiting for a key another rank publishes in the job's store, bounded by the tier's timeout.

A waiting rank must fail with a line that says what it waited for, whether the store itself
went away (its host, rank 0's process, died) or the key never came (its writer failed): never
the store's own timeout, which may be far longer, nor its C++ error text alone.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from offload.errors import PeerError, one_line


def await_key(store: dist.Store, key: str, timeout_s: float, rank: int, waiting_for: str,
              absent: str) -> bytes:
    """The value of ``key`` once it is set, waiting ``timeout_s`` at most (without touching
    the store's own timeout setting).

    Raises:
        PeerError: "rank R lost the store while waiting for ``waiting_for``" when the store's
            host went away; ``absent`` when the key did not come in time.
    """
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
    except dist.DistNetworkError as exc:  # the store's host (rank 0's process) went away
        raise PeerError(f"rank {rank} lost the store while waiting for {waiting_for} "
                        f"({one_line(exc)}); rank 0 died or closed") from None
    except dist.DistError:
        raise PeerError(absent) from None
    return store.get(key)
