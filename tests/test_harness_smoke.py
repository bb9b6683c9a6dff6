from tests.harness import run_group


def test_group_runs_and_reports_errors() -> None:
    def body(rank: int) -> int:
        import torch
        import torch.distributed as dist

        t = torch.tensor([rank + 1])
        dist.all_reduce(t)
        if rank == 1:
            raise ValueError("boom on one")
        return int(t.item())

    out = run_group(body, 2)
    assert out[0].ok and out[0].value == 3
    assert not out[1].ok and "boom on one" in (out[1].error or "")
