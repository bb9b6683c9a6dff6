# SPDX-License-Identifier: Apache-2.0
"""Flags the main job (launch/run.py) and the benchmark scripts use before any process group
exists: ``--timeout`` is the group's own timeout, so a value of 0 or less (or NaN, inf) must be
refused with one line before torch's store sees it -- not a C++ traceback from every rank."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.run import check_before_start
from offload.errors import OffloadError
from tests.harness import has_our_traceback, run_on_free_port, tail

ROOT = Path(__file__).resolve().parents[2]
BAD = ["-1", "0", "-0.5", "nan", "inf"]


def run_script(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("value", BAD)
def test_a_timeout_of_zero_or_less_is_refused_before_the_group_starts(value: str) -> None:
    with pytest.raises(OffloadError, match=f"--timeout {float(value):g} must be a positive"):
        check_before_start(argparse.Namespace(timeout=float(value)))


def test_a_good_timeout_passes() -> None:
    check_before_start(argparse.Namespace(timeout=0.5))


def test_the_main_job_refuses_a_negative_timeout_with_one_line() -> None:
    """Run directly (one rank): exit 1, one line on stderr naming the flag, no traceback."""
    proc = run_script(str(ROOT / "launch" / "run.py"), "--device", "cpu", "--timeout", "-1")
    assert proc.returncode == 1, tail(proc)
    assert proc.stderr.strip().splitlines() == [
        "offload: error: --timeout -1 must be a positive number of seconds; give the seconds a "
        "rank may wait for a peer, e.g. --timeout 300"], tail(proc)


def test_under_torchrun_one_line_for_the_job_and_no_traceback_of_ours() -> None:
    proc = run_on_free_port(
        lambda port: [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                      "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                      port, str(ROOT / "launch" / "run.py"), "--device", "cpu",
                      "--timeout", "0"],
        cwd=ROOT, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0, tail(proc)
    ours = [line for line in proc.stderr.splitlines() if line.startswith("offload: error:")]
    assert ours == ["offload: error: --timeout 0 must be a positive number of seconds; give the "
                    "seconds a rank may wait for a peer, e.g. --timeout 300"], tail(proc)
    assert not has_our_traceback(proc.stderr), tail(proc)
    assert "c10::" not in proc.stderr and "C++" not in proc.stderr, tail(proc)


def test_bench_tier_refuses_a_negative_timeout_with_one_line() -> None:
    proc = run_script(str(ROOT / "scripts" / "bench_tier.py"), "--timeout", "-1",
                      "--device", "cpu")
    assert proc.returncode == 1, tail(proc)
    assert proc.stderr.strip().splitlines() == [
        "bench_tier.py: error: --timeout -1 must be a positive number of seconds; "
        "e.g. --timeout 300"], tail(proc)


@pytest.mark.parametrize("value", ["-1", "0", "nan"])
def test_the_prefix_reload_refuses_a_bad_timeout_in_its_parser(value: str) -> None:
    proc = run_script(str(ROOT / "launch" / "prefix_reload.py"), "--device", "cpu",
                      "--timeout", value)
    assert proc.returncode == 2, tail(proc)
    assert proc.stderr.strip().splitlines()[-1].endswith(
        f"argument --timeout: {value} is not a positive number of seconds; give e.g. "
        "--timeout 300"), tail(proc)
    assert not has_our_traceback(proc.stderr), tail(proc)


@pytest.mark.parametrize(("flags", "expected"), [
    (["--background-setup"], True),
    (["--background-setup", "--no-setup-context"], False),
    ([], True),
])
def test_background_setup_registers_in_its_own_context_unless_told_not_to(
        flags: list[str], expected: bool) -> None:
    from launch.run import build_parser, config_from_args

    args = build_parser().parse_args(["--device", "cpu", *flags])
    config = config_from_args(args, 1)
    assert config.setup_context is expected
    assert config.background is ("--background-setup" in flags)
