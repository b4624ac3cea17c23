"""Data-parallel training (torch.distributed, gloo on the CPU, two real processes on 127.0.0.1): each process
trains on its half of the same global batch and averages gradients, so two processes end where one process
training on the whole batch ends, and with the same weights in both."""

import dataclasses
import os
import random
import socket

import torch
import torch.multiprocessing as mp
from conftest import tiny_target
from safetensors.torch import load_file, save_file

from dspine.drafter import DSpineDraftModel
from dspine.train.loop import TrainConfig, train_drafters

L, STEPS = 20, 3


def _samples() -> list[tuple[list[int], int]]:
    # equal lengths and every position an anchor: each sequence carries the same loss weight, so the mean
    # over the whole batch is exactly the mean of the two halves' means
    rng = random.Random(0)
    return [([rng.randrange(128) for _ in range(L)], 1) for _ in range(8)]


def _cfg() -> TrainConfig:
    return TrainConfig(
        steps=STEPS, batch_size=4, anchors_per_seq=L - 1, max_len=64, lr=3e-3, warmup_steps=1, gamma=3.5, eval_every=100
    )


def _train() -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    # float64: the all-reduce sums the halves in another order than one process does, and Adam divides
    # gradients near zero by their own size, so fp32 rounding alone could move a weight past the tolerance
    target = tiny_target("llama", dtype=torch.float64)
    drafters = {
        m: DSpineDraftModel.for_target(target, method=m, num_hidden_layers=2, block_size=4, seed=0).double()
        for m in ("dspine", "dflash")
    }
    hist = train_drafters(drafters, target, _samples(), _cfg(), progress=False)
    out = {f"{m}.{k}": v.detach().clone() for m, d in drafters.items() for k, v in d.state_dict().items()}
    out["first_loss"] = torch.tensor([hist["dspine"][0]["loss"]], dtype=torch.float64)  # this process's batch
    return out


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    from dspine.train.loop import init_distributed

    assert init_distributed("cpu") == (rank, world)
    target = tiny_target("llama")
    d = DSpineDraftModel.for_target(target, method="dflash", num_hidden_layers=1, block_size=4)
    try:  # a global batch that does not split evenly is refused by every process, before any collective
        train_drafters({"x": d}, target, _samples(), dataclasses.replace(_cfg(), batch_size=3), progress=False)
    except ValueError as e:
        open(os.path.join(out, f"error{rank}.txt"), "w").write(str(e))
    save_file(_train(), os.path.join(out, f"rank{rank}.safetensors"))
    import torch.distributed as dist

    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_train_like_one(tmp_path):
    one = _train()
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (load_file(str(tmp_path / f"rank{r}.safetensors")) for r in (0, 1))
    assert set(r0) == set(one)
    # each process saw half of the batch (its own loss), and the halves make up the whole
    l0, l1, whole = (x.pop("first_loss").item() for x in (r0, r1, one))
    assert abs(l0 - l1) > 1e-4 and abs((l0 + l1) / 2 - whole) < 1e-5
    assert all(torch.equal(r0[k], r1[k]) for k in one)  # the processes stay in step exactly
    assert all(torch.allclose(r0[k], one[k], atol=2e-5, rtol=1e-4) for k in one)  # and train as one process
    write = "dspine.injections.1.write.weight"  # zero at the start: training moved it
    assert r0[write].abs().max() > 1e-3
    for r in (0, 1):
        assert "multiple of the 2 processes" in (tmp_path / f"error{r}.txt").read_text()
