"""The README's library example runs as written (2 ranks under torchrun)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from tests.harness import run_on_free_port, tail

ROOT = Path(__file__).resolve().parents[1]


def test_library_example_runs(tmp_path: Path, shm_dir: str) -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    example = next(b for b in blocks if "HostTier.create" in b)
    script = tmp_path / "example.py"
    assert example.count("TierConfig(") == 1
    # the example as written, with its regions in this test's own shm dir for the leak check
    script.write_text(example.replace("TierConfig(", f"TierConfig(shm_dir={shm_dir!r}, "))
    proc = run_on_free_port(
        lambda port: [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                      "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                      port, str(script)],
        cwd=tmp_path, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, tail(proc)
