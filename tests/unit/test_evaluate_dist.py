"""Two gloo ranks score each val sample exactly once: the counts equal a single process's; the linear
probe (its image cap global, its l2 chosen on held-out data) reports the same numbers on 1 and 2 ranks."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.config import DataCfg
from pipeline.eval.evaluators import score_model
from pipeline.model import build_vit
from pipeline.network import free_port

DATA = "synthetic:classes=3,train=30,val=21"  # 21 = an uneven split over 2 ranks


def _model():
    torch.manual_seed(0)
    m = build_vit(width=16, depth=1, heads=2, mlp_dim=32, patch=4, img_size=8, num_classes=3)
    torch.nn.init.normal_(m.head.weight)  # a non-trivial head so predictions differ per sample
    return m


def _worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    res = score_model(_model(), DataCfg(path=DATA), batch=4, fewshot_cfg=None, linear_probe=True, max_train_images=17)
    if rank == 0:
        torch.save({k: v for k, v in res.items() if isinstance(v, float)}, out)
    dist.destroy_process_group()


def test_two_ranks_equal_one(tmp_path):
    port = free_port()
    out = tmp_path / "r.pt"
    mp.start_processes(_worker, args=(port, str(out)), nprocs=2, start_method="spawn")
    two = torch.load(out, weights_only=True)
    one = score_model(_model(), DataCfg(path=DATA), batch=4, linear_probe=True, max_train_images=17)
    assert two["val/n"] == 21
    for k in ("val/top1", "val/top5", "val/loss", "linear_probe/top1", "linear_probe/train_top1",
              "linear_probe/heldout_top1", "linear_probe/l2"):
        assert abs(two[k] - one[k]) < 1e-6, k
    assert one["linear_probe/l2"] in (1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
