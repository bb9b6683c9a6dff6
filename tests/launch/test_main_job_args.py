# SPDX-License-Identifier: Apache-2.0
"""Flags the main job (launch/run.py) and the benchmark scripts use before any process group
exists: ``--timeout`` is the group's own timeout, so a value of 0 or less, NaN, or one past the
longest wait the platform allows (`offload.bounds.MAX_WAIT_S`) must be refused with one line
before torch's store sees it -- not a C++ traceback from every rank; ``--fs-io-timeout`` and
the scripts' size flags get the same one-line refusals."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch.run import check_before_start
from offload.bounds import MAX_WAIT_S
from offload.errors import OffloadError
from tests.harness import has_our_traceback, run_on_free_port, tail

ROOT = Path(__file__).resolve().parents[2]
BAD = ["-1", "0", "-0.5", "nan", "inf", "1e10"]


def run_script(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("value", BAD)
def test_a_timeout_of_zero_or_less_or_past_the_bound_is_refused_before_the_group_starts(
        value: str) -> None:
    flags = argparse.Namespace(timeout=float(value), fs_io_timeout=5.0)
    with pytest.raises(OffloadError, match=f"^--timeout {re.escape(f'{float(value):g}')} (must "
                                           "be positive|is past the longest wait the platform "
                                           "allows)"):
        check_before_start(flags)
    flags = argparse.Namespace(timeout=300.0, fs_io_timeout=float(value))
    with pytest.raises(OffloadError, match=f"^--fs-io-timeout {re.escape(f'{float(value):g}')} "):
        check_before_start(flags)


def test_good_timeouts_pass() -> None:
    check_before_start(argparse.Namespace(timeout=0.5, fs_io_timeout=MAX_WAIT_S))


@pytest.mark.parametrize(("flag", "value", "line"), [
    ("--timeout", "-1", "--timeout -1 must be positive; give the seconds a rank may wait for a "
                        "peer, e.g. --timeout 300"),
    ("--timeout", "1e10", "--timeout 1e+10 is past the longest wait the platform allows, 1e+09 s "
                          "(32 years); give the seconds a rank may wait for a peer, e.g. "
                          "--timeout 300"),
    ("--fs-io-timeout", "inf", "--fs-io-timeout inf is past the longest wait the platform "
                               "allows, 1e+09 s (32 years); give the seconds one file-tier read "
                               "or write may take, e.g. --fs-io-timeout 5"),
])
def test_the_main_job_refuses_a_bad_timeout_with_one_line(flag: str, value: str,
                                                          line: str) -> None:
    """Run directly (one rank): exit 1, one line on stderr naming the flag, no traceback.
    ``--timeout 1e10`` used to reach torch's store (DistNetworkError and its C++ frames),
    ``--fs-io-timeout inf`` an OverflowError in the middle of a store."""
    proc = run_script(str(ROOT / "launch" / "run.py"), "--device", "cpu", flag, value)
    assert proc.returncode == 1, tail(proc)
    assert proc.stderr.strip().splitlines() == [f"offload: error: {line}"], tail(proc)


def test_under_torchrun_one_line_for_the_job_and_no_traceback_of_ours() -> None:
    proc = run_on_free_port(
        lambda port: [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                      "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                      port, str(ROOT / "launch" / "run.py"), "--device", "cpu",
                      "--timeout", "0"],
        cwd=ROOT, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0, tail(proc)
    ours = [line for line in proc.stderr.splitlines() if line.startswith("offload: error:")]
    assert ours == ["offload: error: --timeout 0 must be positive; give the seconds a rank may "
                    "wait for a peer, e.g. --timeout 300"], tail(proc)
    assert not has_our_traceback(proc.stderr), tail(proc)
    assert "c10::" not in proc.stderr and "C++" not in proc.stderr, tail(proc)


@pytest.mark.parametrize("value", ["-1", "1e10"])
def test_bench_tier_refuses_a_bad_timeout_in_its_parser(value: str) -> None:
    proc = run_script(str(ROOT / "scripts" / "bench_tier.py"), "--timeout", value,
                      "--device", "cpu")
    assert proc.returncode == 2, tail(proc)
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"bench_tier.py: error: argument --timeout: {float(value):g} "), tail(proc)
    assert not has_our_traceback(proc.stderr), tail(proc)


@pytest.mark.parametrize(("script", "flags", "line"), [
    ("bench_fs.py", ["--bytes", "99999999TiB"], "bench_fs.py: error: argument --bytes: "
     "'99999999TiB' is above the largest size, 9223372036854775807 B (8 EiB, what a file offset "
     "holds); give a smaller size"),
    ("bench_transfer.py", ["--sizes", "4KiB,zz"], "bench_transfer.py: error: argument --sizes: "
     "'zz' is not a size; write a byte count such as 4096, 64KiB, 256MiB or 4GiB"),
])
def test_the_scripts_refuse_a_bad_size_in_their_parser(script: str, flags: list[str],
                                                       line: str) -> None:
    """A size flag the parser used to hand over as text (or parse into an OffloadError with a
    traceback) is refused by argparse with the one line."""
    proc = run_script(str(ROOT / "scripts" / script), *flags)
    assert proc.returncode == 2, tail(proc)
    assert proc.stderr.strip().splitlines()[-1] == line, tail(proc)
    assert not has_our_traceback(proc.stderr), tail(proc)


@pytest.mark.parametrize("value", ["-1", "0", "nan", "1e10"])
def test_the_prefix_reload_refuses_a_bad_timeout_with_one_line(value: str) -> None:
    proc = run_script(str(ROOT / "launch" / "prefix_reload.py"), "--device", "cpu",
                      "--timeout", value)
    assert proc.returncode == 1, tail(proc)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"offload: error: --timeout {float(value):g} "), tail(proc)
    assert lines[0].endswith("give the seconds a rank may wait for a peer, e.g. --timeout 300")


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
