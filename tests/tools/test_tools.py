# SPDX-License-Identifier: Apache-2.0
"""The developer tools in `tools/`: the stack and wait samplers `scripts/bench_startup.py` uses
for its probes, and `bench_registrations.py`, which times the driver's host registrations one
by one.  Their figures are the device's business (docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import tail

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "scripts"))  # bench_startup, which the samplers serve



def test_the_stack_sampler_sees_a_thread_that_holds_the_gil() -> None:
    """A C call that holds the GIL (``sum`` over a range) delays the sampler's wake-ups: it
    reports the stall and what the main thread was doing right after."""
    import stack_sampler

    sampler = stack_sampler.StackSampler(interval_s=0.005, late_s=0.05).start()
    try:
        import time

        time.sleep(0.05)
        sum(range(30_000_000))  # ~0.3-1 s in C, the GIL held throughout
        time.sleep(0.05)
    finally:
        sampler.stop()
    assert sampler.late and max(gap for _, gap, _ in sampler.late) > 0.1
    assert "wake-ups later than 50 ms" in sampler.report()


def test_the_wait_sampler_says_what_a_long_step_waits_for_in_the_kernel() -> None:
    """A step that sleeps and one that waits for a lock another thread holds, each 20 ms,
    read from the child process: a sleep, a futex; a short step is not sampled."""
    import threading
    import time

    import wait_sampler

    sampler = wait_sampler.WaitSampler(after_s=0.002)
    try:
        short = sampler.begin(1)
        sampler.end()
        sleeping = sampler.begin(1)
        time.sleep(0.02)
        sampler.end()
        lock = threading.Lock()
        lock.acquire()
        threading.Timer(0.02, lock.release).start()
        locked = sampler.begin(2)
        with lock:
            sampler.end()
    finally:
        steps = sampler.stop()
    assert short not in steps
    assert steps[sleeping]["phase"] == 1 and steps[locked]["phase"] == 2
    assert "sleep" in sampler.where(sleeping) and sampler.where(sleeping).startswith("S ")
    assert "futex" in sampler.where(locked)
    assert sampler.where(short) == "no sample"


def test_the_wait_sampler_reads_the_other_threads_at_each_long_step() -> None:
    """Beside a long step, a spinning thread is seen awake (``R``, with its role) and a
    sleeping one asleep, each counted under its role; the pin thread's wait is shown asleep
    too (a registration sleeping in the kernel holds the driver all the same)."""
    import threading
    import time

    import wait_sampler

    stop = threading.Event()
    ids: dict[int, str] = {}
    ready = threading.Barrier(4)

    def spin() -> None:
        ids[threading.get_native_id()] = "spin"
        ready.wait()
        while not stop.is_set():
            pass

    def nap(role: str) -> None:
        ids[threading.get_native_id()] = role
        ready.wait()
        stop.wait()

    threads = [threading.Thread(target=f, args=a, daemon=True)
               for f, a in ((spin, ()), (nap, ("nap",)), (nap, ("pin",)))]
    for t in threads:
        t.start()
    ready.wait()
    sampler = wait_sampler.WaitSampler(after_s=0.002, others=ids)
    try:
        step = sampler.begin(1)
        time.sleep(0.05)
        sampler.end()
    finally:
        stop.set()
        steps = sampler.stop()
        for t in threads:
            t.join()
    beside = steps[step]["others"]  # (a sample as the step ends may catch the GIL's hand-off)
    assert beside and sum(line.startswith("nap S1; pin S1; spin R1") for line in beside
                          ) > len(beside) // 2
    awake = [line.split(" | ", 1)[-1] for line in beside]
    assert all("pin S: " in line and "nap S:" not in line for line in awake), beside
    where = sampler.where(step)
    assert "; beside: nap S1; pin S1; spin R1 (" in where and " | spin R" in where, where


def test_a_step_past_20_ms_reads_what_runs_elsewhere_on_the_host() -> None:
    """Once a step has run `HOST_AFTER_S`, the sampler reads the host's other running tasks
    once: a process spinning elsewhere is named with its state."""
    import time

    import wait_sampler

    spinner = subprocess.Popen([sys.executable, "-c", "open('/proc/self/comm', 'w').write("
                                "'spin-elsewhere'); print(flush=True)\nwhile True: pass"],
                               stdout=subprocess.PIPE, text=True)
    # a task named with a character cut in half (names are cut at 15 bytes) must not break it
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; open('/proc/self/comm', "
                                "'wb').write('Überprüfungsé'.encode()[:15]); print(flush=True); "
                                "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        for child in (spinner, sleeper):
            assert child.stdout is not None and child.stdout.readline() == "\n"
        sampler = wait_sampler.WaitSampler(after_s=0.002)
        step = sampler.begin(1)
        time.sleep(0.2)
        sampler.end()
        sampler.stop()
    finally:
        for child in (spinner, sleeper):
            child.kill()
            child.wait()
    host = sampler.steps[step]["host"]
    assert any(line.startswith("spin-elsewhere R") for line in host), host
    assert "; elsewhere: " in sampler.where(step) and "spin-elsewhere R" in sampler.where(step)


def test_the_cuda_drivers_threads_are_told_from_the_others_by_name() -> None:
    """`bench_startup.process_threads`: every thread of the process, those named ``cuda...``
    (as the driver names its own) as ``driver``."""
    import threading

    import bench_startup

    named, stop = threading.Event(), threading.Event()
    ids: list[int] = []

    def driver_like() -> None:
        ids.append(threading.get_native_id())
        with open(f"/proc/self/task/{ids[0]}/comm", "w") as f:
            f.write("cuda-EvtHandlr")
        named.set()
        stop.wait()

    thread = threading.Thread(target=driver_like, daemon=True)
    thread.start()
    try:
        assert named.wait(10)
        before = {int(t) for t in os.listdir("/proc/self/task")}
        found = bench_startup.process_threads()
        after = {int(t) for t in os.listdir("/proc/self/task")}
        assert found[ids[0]] == "driver" and found[threading.get_native_id()] == "thread"
        assert before & after <= set(found) <= before | after  # threads may come and go
    finally:
        stop.set()
        thread.join()


def test_bench_registrations_registers_in_order_and_lists_the_slow_calls(tmp_path: Path) -> None:
    """With the recording stand-in: the whole range once, then each unit size in order, every
    call listed (``--slow-ms -1``) with its number among the process's registrations and the
    bytes of its size before it, and a bad size is one line naming it."""
    out = tmp_path / "registrations.json"
    run = [sys.executable, str(ROOT / "tools" / "bench_registrations.py"), "--device", "cpu",
           "--bytes", "8MiB", "--threads", "2"]
    proc = subprocess.run([*run, "--units", "1MiB,4MiB", "--memory", "memfd", "--slow-ms", "-1",
                           "--json", str(out)], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, tail(proc, 2000)
    report = json.loads(out.read_text())
    assert report["whole"]["calls"] == 1 and report["whole"]["slow"][0][:2] == [1, 0]
    assert [(r["unit"], r["calls"]) for r in report["units"]] == [(1 << 20, 8), (4 << 20, 2)]
    assert [(n, before) for n, before, _ in report["units"][0]["slow"]] == [
        (2 + i, i << 20) for i in range(8)]
    assert [n for n, _, _ in report["units"][1]["slow"]] == [10, 11]
    proc = subprocess.run([*run, "--units", "3KiB"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "3072 is not; give e.g. 8MiB" in proc.stderr
    # without the baseline, and populated beside as set-up does: the units come first
    for mode in (["--no-whole"], ["--populate", "beside"]):
        proc = subprocess.run([*run, "--units", "1MiB", "--slow-ms", "-1", "--json", str(out),
                               *mode], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 0, tail(proc, 2000)
        report = json.loads(out.read_text())
        assert report["whole"] is None
        assert report["populate"] == ("beside" if "beside" in mode else "first")
        assert [(n, before) for n, before, _ in report["units"][0]["slow"]] == [
            (1 + i, i << 20) for i in range(8)], mode
    proc = subprocess.run([*run, "--units", "1MiB", "--populate", "beside", "--whole"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "give one --units size and leave out --whole" in proc.stderr
    for option, name in ((["--probe"], "--probe"), (["--before", "cubin"], "--before")):
        proc = subprocess.run([*run, *option], capture_output=True, text=True, timeout=120,
                              cwd=ROOT)
        assert proc.returncode == 2 and f"{name} launches kernels and needs CUDA" in proc.stderr


def test_bench_registrations_unregisters_everything_when_a_call_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A registration refused part-way (the 6th call of the process): every range registered
    is unregistered, the registrar closed, the memory unmapped, and the error raised."""
    import bench_registrations

    from offload.region.pin import RecordingRegistrar
    from offload.system.shm import Mapping

    class Refusing(RecordingRegistrar):
        closed = False

        def register(self, address: int, length: int) -> None:
            if self.calls == 5:
                raise RuntimeError("stand-in: refused")
            super().register(address, length)

        def close(self) -> None:
            self.closed = True

    registrar = Refusing()
    monkeypatch.setattr(bench_registrations, "choose_registrar", lambda *a, **k: registrar)
    mappings: list[Mapping] = []
    anonymous = Mapping.anonymous
    monkeypatch.setattr(Mapping, "anonymous",
                        lambda size: mappings.append(anonymous(size)) or mappings[-1])
    with pytest.raises(RuntimeError, match="stand-in: refused"):
        bench_registrations.main(["--device", "cpu", "--bytes", "8MiB", "--units", "1MiB",
                                  "--threads", "2"])
    assert registrar.calls == 5 and registrar.registered == {} and registrar.closed
    assert [m.size for m in mappings] == [0]  # unmapped


def _finished_probe(began: list[float], waits: list[float]) -> Any:
    """`bench_startup.LaunchProbe` holding made-up launches, its thread already finished."""
    import threading

    import bench_startup

    probe = bench_startup.LaunchProbe.__new__(bench_startup.LaunchProbe)
    probe._stop, probe.sampler = False, None
    probe._thread = threading.Thread(target=lambda: None)
    probe._thread.start()
    probe.began, probe.waits = began, waits
    probe.maps, probe.steps, probe.launch_s = [0.0] * len(began), [], []
    return probe


def test_bench_registrations_prints_the_probe_beside_the_registration_it_overlapped(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The probe's summary as `bench_registrations --probe` prints it: only launches from the
    first registration on, the worst one named with the (began, seconds) registration call it
    overlapped, or with none."""
    import bench_registrations

    began, waits = [9.0, 10.0, 10.01, 10.02], [0.5, 0.0001, 0.05, 0.0003]  # the first: before
    bench_registrations._print_probe(_finished_probe(began, waits).stop([(10.005, 0.06)], 9.5))
    out = capsys.readouterr().out
    assert "3 launches" in out and "worst 50.0 ms at 0.51 s" in out, out
    assert "beside a registration of 60.0 ms, 1 over 2 ms" in out, out
    bench_registrations._print_probe(_finished_probe(began, waits).stop([(10.2, 0.06)], 9.5))
    assert "worst 50.0 ms at 0.51 s beside no registration call" in capsys.readouterr().out
