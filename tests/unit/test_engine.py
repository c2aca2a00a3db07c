"""Config → DeepSpeed JSON, the optimizer/param-group plumbing, schedules and the synthetic loader."""

import sys
import warnings

import pytest
import torch

from pipeline.config import load_config
from pipeline.train.schedule import lr_at

TINY = "configs/pretrain/tiny_cpu.yaml"


def cfg_with(*overrides, world_size=2):
    return load_config(TINY, ["data.path=synthetic", *overrides], world_size=world_size)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_config_per_stage(stage):
    from pipeline.train.engine import deepspeed_config

    cfg = cfg_with(f"engine.zero_stage={stage}", "train.global_batch=64", "train.micro_batch=8",
                   "optim.clip_grad=0.5")
    ds = deepspeed_config(cfg, world_size=2)
    assert ds["train_batch_size"] == 64
    assert ds["train_micro_batch_size_per_gpu"] == 8
    assert ds["gradient_accumulation_steps"] == 4  # 64 / (8 x 2)
    assert ds["gradient_clipping"] == 0.5
    assert ds["zero_optimization"]["stage"] == stage
    assert ds["bf16"]["enabled"] is False and ds["fp16"]["enabled"] is False
    assert ("stage3_param_persistence_threshold" in ds["zero_optimization"]) == (stage == 3)
    assert "offload_optimizer" not in ds["zero_optimization"]
    assert ds["checkpoint"]["load_universal"] is False


def test_deepspeed_config_precision_offload_and_world():
    from pipeline.train.engine import deepspeed_config

    cfg = cfg_with("engine.zero_stage=3", "engine.precision=bf16", "engine.offload_optimizer=true",
                   "engine.offload_params=true", "train.global_batch=128", world_size=4)
    ds = deepspeed_config(cfg, world_size=4, load_universal=True)
    assert ds["bf16"]["enabled"] is True
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ds["gradient_accumulation_steps"] == 2  # 128 / (16 x 4)
    assert ds["checkpoint"]["load_universal"] is True
    assert ds["zero_force_ds_cpu_optimizer"] is False  # torch AdamW: no compiled CPU Adam needed
    fp16 = deepspeed_config(cfg_with("engine.precision=fp16"), world_size=2)
    assert fp16["fp16"]["enabled"] and fp16["fp16"]["loss_scale"] == 0  # dynamic loss scaling


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_precision_keys_per_stage(stage, precision):
    """Gradients accumulate in fp32 wherever DeepSpeed allows it (stage 0 takes no bf16/fp16 model with
    fp32 accumulation); bf16 runs without overflow checks and adds gradients to the fp32 buffer as they
    come (the knobs' names as deepspeed 0.19.8 reads them: a wrong key in the bf16 section is an error)."""
    from deepspeed.runtime.config import DtypeEnum
    from deepspeed.runtime.precision_config import get_bfloat16_config

    from pipeline.train.engine import deepspeed_config

    cfg = cfg_with(f"engine.zero_stage={stage}", f"engine.precision={precision}")
    ds = deepspeed_config(cfg, world_size=2)
    assert ds["bf16"] == {"enabled": precision == "bf16", "immediate_grad_update": True,
                          "check_grad_overflow": False}
    assert ds["fp16"]["enabled"] is (precision == "fp16")
    fp32_accum = stage >= 1 or precision == "fp32"
    assert ds.get("data_types") == ({"grad_accum_dtype": "fp32"} if fp32_accum else None)
    # DeepSpeed's own parser takes the bf16 keys (pydantic, unknown keys forbidden) and the dtype name
    bf16 = get_bfloat16_config(ds)
    assert (bf16.immediate_grad_update, bf16.check_grad_overflow) == (True, False)
    with pytest.raises(ValueError, match="check_overflow"):  # the name in deepspeed's constants.py is dead
        get_bfloat16_config({"bf16": {"enabled": True, "check_overflow": False}})
    if fp32_accum:
        assert DtypeEnum(ds["data_types"]["grad_accum_dtype"]).value == torch.float32
    # gradients reduced in fp32; nothing of DeepSpeed's bookkeeping synchronises in a step
    from deepspeed.comm.config import DeepSpeedCommsConfig
    from deepspeed.runtime.config import get_communication_data_type
    from deepspeed.utils.config import get_timers_config

    assert get_communication_data_type(ds) == torch.float32
    assert get_timers_config(ds).enabled is False
    assert DeepSpeedCommsConfig(ds).comms_logger_enabled is False  # the key's presence alone enables it


def test_default_param_groups_skip_decay_on_norms_biases_embeddings():
    from pipeline.model import build_vit
    from pipeline.train.engine import default_param_groups

    m = build_vit(width=16, depth=1, heads=2, mlp_dim=32, patch=4, img_size=8, num_classes=3)
    decay, no_decay = default_param_groups(m, 0.1)
    names = {id(p): n for n, p in m.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {names[id(p)] for p in no_decay["params"]} >= {"pos_embed", "cls_token", "norm.weight", "head.bias"}
    assert all(p.ndim == 2 or p.ndim == 4 for p in decay["params"])


@pytest.fixture
def one_rank(monkeypatch):
    """A 1-rank gloo group for an in-process DeepSpeed engine; destroyed afterwards."""
    import torch.distributed as dist

    from pipeline.network import free_port

    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)  # restored afterwards, so other tests see no launcher
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    # DeepSpeed keeps the groups it made (its clone of the world, the data-parallel group) in module
    # globals, released only when the group is destroyed through deepspeed.comm: a later engine in
    # this process would broadcast over a destroyed group
    ds_groups = sys.modules.get("deepspeed.utils.groups")
    if ds_groups is not None:
        ds_groups._release_process_group_references()


def test_collective_timeout_bounds_every_group_deepspeed_made_too(one_rank):
    """engine.collective_timeout_s on every group and the store once the ranks have met, DeepSpeed's
    data-parallel group included: DeepSpeed makes it with new_group() and no timeout, which gets
    torch's default (gloo 30 min, NCCL 10 min), not the default group's."""
    import datetime

    import torch.distributed as dist

    from pipeline.distributed import setup
    from pipeline.model import build_vit
    from pipeline.train import engine

    cfg = cfg_with("engine.rendezvous_timeout_s=5", "engine.collective_timeout_s=77", "train.global_batch=16",
                   "train.micro_batch=16", world_size=1)
    setup(cfg)
    eng = engine.build_engine(build_vit(width=16, depth=1, heads=2, mlp_dim=32, patch=4, img_size=8,
                                        num_classes=3), cfg)
    bound = datetime.timedelta(seconds=77)
    groups = list(dist.distributed_c10d._world.pg_map)
    assert eng.seq_data_parallel_group in groups and eng.seq_data_parallel_group is not dist.group.WORLD
    assert [g._get_backend(torch.device("cpu")).options._timeout for g in groups] == [bound] * len(groups)
    assert dist.distributed_c10d._get_default_store().timeout == bound


def _sgd_step(model, groups, x, y, lr):
    """One SGD step through DeepSpeed ZeRO-1 (no clipping, no decay) → (update, gradient) per parameter
    name; the gradient comes from an untouched copy of the model, so nothing is read from the engine."""
    import copy

    import torch.nn.functional as F

    from pipeline.distributed import setup
    from pipeline.train import engine

    cfg = cfg_with("optim.name=sgd", "optim.momentum=0.9", "optim.weight_decay=0", "optim.clip_grad=0",
                   "engine.zero_stage=1", f"train.global_batch={len(x)}", f"train.micro_batch={len(x)}",
                   world_size=1)
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(x), y).backward()
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    setup(cfg)
    eng = engine.build_engine(model, cfg, param_groups=groups)
    engine.set_lr(eng, lr)
    eng.backward(F.cross_entropy(eng(x), y))
    eng.step()  # the first SGD step: momentum buffer = gradient, so update = lr x lr_scale x gradient
    assert engine.grad_norm(eng) > 0
    return {n: before[n] - p.detach() for n, p in model.named_parameters()}, grads, eng


def test_lr_scale_scales_the_update_as_layer_wise_decay(one_rank):
    """The transfer stage's SGD + layer-wise lr decay groups (``lr_scale`` per group) through DeepSpeed
    ZeRO-1: every parameter moves by lr x lr_scale x its gradient, so block i (of depth) moves by
    lr x decay^(depth - i), patch embedding / class token / pos-emb by decay^(depth + 1), final norm and
    head by lr. (One engine per process: DeepSpeed keeps its process groups in module globals.)"""
    from pipeline.model import build_vit
    from pipeline.train.engine import param_groups_layer_decay

    torch.manual_seed(0)
    depth, decay, lr = 3, 0.5, 0.1
    model = build_vit(width=16, depth=depth, heads=2, mlp_dim=32, patch=4, img_size=8, num_classes=3)
    with torch.no_grad():  # the zero-initialised head would give every other layer a zero gradient
        model.head.weight.normal_(0, 0.5)
    groups = param_groups_layer_decay(model, decay, weight_decay=0.0)
    scale = {id(p): g["lr_scale"] for g in groups for p in g["params"]}
    want_scale = {n: scale[id(p)] for n, p in model.named_parameters()}
    update, grad, eng = _sgd_step(model, groups, torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 0]), lr)
    assert sorted(g["lr"] for g in eng.optimizer.param_groups) == pytest.approx(
        sorted(lr * decay ** k for k in range(depth + 2)))  # set_lr applies each group's scale
    for name, g in grad.items():
        assert g.abs().sum() > 0, name
        # (atol: the update is a difference of fp32 weights, exact to ~1e-7 of them)
        torch.testing.assert_close(update[name], lr * want_scale[name] * g, rtol=1e-3, atol=1e-7)

    def block_ratio(prefix: str) -> float:  # |update| / (lr |gradient|) over a block's parameters
        names = [n for n in grad if n.startswith(prefix)]
        u = torch.cat([update[n].flatten() for n in names]).double()
        g = torch.cat([grad[n].flatten() for n in names]).double()
        return (u.norm() / g.norm()).item() / lr

    got = [block_ratio(f"blocks.{i}.") for i in range(depth)]
    assert got == pytest.approx([decay ** (depth - i) for i in range(depth)], rel=1e-4)  # 0.125, 0.25, 0.5
    for prefix in ("patch_embed.", "pos_embed", "cls_token"):
        assert block_ratio(prefix) == pytest.approx(decay ** (depth + 1), rel=1e-4), prefix
    for prefix in ("norm.", "pre_logits.", "head."):
        if any(n.startswith(prefix) for n in grad):
            assert block_ratio(prefix) == pytest.approx(1.0, rel=1e-4), prefix


def test_lr_schedule_warmup_then_decay():
    kw = dict(lr=1.0, total_steps=110, warmup_steps=10)
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw, decay="linear") == pytest.approx(0.5)
    assert lr_at(60, **kw, decay="cosine") == pytest.approx(0.5)
    assert lr_at(110, **kw, decay="cosine", end_lr=0.01) == pytest.approx(0.01)
    assert lr_at(100, **kw, decay="constant") == 1.0


def test_synthetic_loader_is_deterministic_resumable_and_world_size_independent():
    from pipeline.data import synthetic

    cfg = cfg_with("data.path=synthetic:classes=5,train=64", world_size=1)
    one = synthetic.TrainLoader(cfg.data, img_size=8, micro_batch=4, global_batch=8, world_size=1)
    it = iter(one)
    first = [next(it) for _ in range(4)]  # 2 steps x 2 accumulation
    ranks = [synthetic.TrainLoader(cfg.data, img_size=8, micro_batch=4, global_batch=8, rank=r, world_size=2)
             for r in range(2)]
    its = [iter(r) for r in ranks]
    for step in range(2):
        a = torch.cat([first[2 * step][1], first[2 * step + 1][1]])
        b = torch.cat([next(its[0])[1], next(its[1])[1]])
        assert torch.equal(a, b)  # the same samples per optimizer step on 1 or 2 ranks
    state = one.state_dict()
    assert state["steps"] == 2
    again = synthetic.TrainLoader(cfg.data, img_size=8, micro_batch=4, global_batch=8, world_size=1)
    again.load_state_dict(state)
    x1, y1 = next(it)
    x2, y2 = next(iter(again))
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and x1.dtype == torch.uint8


def test_synthetic_eval_covers_each_sample_once():
    from pipeline.data import synthetic

    cfg = cfg_with("data.path=synthetic:val=10", world_size=1)
    loaders = [synthetic.EvalLoader(cfg.data, img_size=8, batch=2, rank=r, world_size=3) for r in range(3)]
    assert [len(ld) for ld in loaders] == [2, 2, 2]  # lock-step batches on every rank
    seen = [int(v.sum()) for ld in loaders for _, _, v in ld]
    assert sum(seen) == 10
    with pytest.raises(ValueError, match="synthetic option"):
        synthetic.parse_spec("synthetic:colours=3")


@pytest.mark.slow
def test_train_compile_compiles_each_block_and_keeps_the_numbers():
    """train.compile=true: every block compiled in place (real inductor on the CPU), same logits and
    gradients as eager within float tolerance; the default on a CPU node is off."""
    from pipeline.config import load_config
    from pipeline.model import build_vit
    from pipeline.train.engine import compile_blocks

    torch.manual_seed(0)
    kw = dict(width=32, depth=2, heads=2, mlp_dim=64, patch=4, img_size=16, num_classes=5)
    eager, compiled = build_vit(**kw), build_vit(**kw)
    compiled.load_state_dict(eager.state_dict())
    cfg = load_config("configs/pretrain/tiny_cpu.yaml", ["train.compile=true"])
    assert compile_blocks(compiled, cfg) == 2
    assert compile_blocks(build_vit(**kw), load_config("configs/pretrain/tiny_cpu.yaml", [])) == 0
    x = torch.randn(3, 3, 16, 16)
    a, b = eager(x), compiled(x)
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    a.sum().backward()
    b.sum().backward()
    torch.testing.assert_close(compiled.blocks[0].mlp.fc1.weight.grad, eager.blocks[0].mlp.fc1.weight.grad,
                               rtol=1e-4, atol=1e-5)



class _Graphs:
    """A torch.compile backend that runs each graph Dynamo captured as it is and counts them: one per
    cache entry of a function without graph breaks."""

    def __init__(self):
        self.made = 0

    def __call__(self, gm, example_inputs):
        self.made += 1
        return gm.forward


class _ShortRank(list):
    """A rank's evaluation batches that end before the other ranks' (its len counts one more): the
    eval loop feeds it a dummy batch for the missing one."""

    def __len__(self) -> int:
        return super().__len__() + 1


def test_compiled_blocks_stay_within_their_variants_and_say_when_one_falls_back():
    """Compiled blocks through training with patch dropping, validation with a dummy batch, training on
    every patch (past train.patch_drop_until) and validation again: Dynamo's entries for the blocks
    (shared by all of them) stay within block_variants, under the limit compile_blocks set. With the
    limit forced to 1, the last block falls back with one warning line. The entries are Dynamo's (its
    guards decide them, whatever backend compiles the graphs): a backend that runs the graphs as they
    are and counts them keeps this test to seconds, where inductor takes two minutes on a cold cache
    (the tiny run measured with inductor made the same entries: the README's GPU section)."""
    from pipeline.eval.loop import classify
    from pipeline.model import build_vit, draw_keep
    from pipeline.train import compiled

    kw = dict(width=32, depth=2, heads=2, mlp_dim=64, patch=4, img_size=16, num_classes=5)
    cfg = load_config(TINY, ["train.compile=true", "model.patch_drop=0.5", "eval.batch=6"])
    graphs = _Graphs()
    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        model = build_vit(**kw)
        assert compiled.compile_blocks(model, cfg, backend=graphs) == 2
        bound = compiled.block_variants(model, cfg)
        assert bound == 6 and torch._dynamo.config.recompile_limit >= bound
        dummy_shape = (cfg.eval.batch, 3, 16, 16)  # the classify evaluator's: a full eval batch
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4, 3, 16, 16)
        evals = _ShortRank([(torch.randint(0, 256, (6, 3, 16, 16), dtype=torch.uint8), torch.arange(6) % 5)])
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no block falls back
            for keep in (draw_keep(4, 16, 0.5, g), draw_keep(4, 16, 0.5, g), None, None):
                model.train()
                model(x, keep=keep).logsumexp(-1).sum().backward()
                res = classify(model, evals, 5, prepare=lambda im: im.float() / 255, dummy_shape=dummy_shape)
                assert res.n == 6  # the dummy batch counts no image
        assert 0 < graphs.made <= bound

        torch._dynamo.reset()
        fresh = build_vit(**kw)
        fresh.load_state_dict(model.state_dict())
        compiled.compile_blocks(fresh, cfg, backend=(one := _Graphs()))
        with torch._dynamo.config.patch(recompile_limit=1), pytest.warns(RuntimeWarning) as got:
            out = fresh(x)  # blocks.0 compiles the one entry; the last block's token-0 path fits none
        lines = [str(w.message) for w in got if "runs uncompiled" in str(w.message)]
        assert len(lines) == 1 and "\n" not in lines[0], lines
        assert lines[0].startswith("blocks.1 runs uncompiled: Dynamo's recompile_limit (1)"), lines[0]
        assert "first_token_only" in lines[0]  # the reason: the guard that failed
        assert one.made == 1
        eager = build_vit(**kw)
        eager.load_state_dict(model.state_dict())
        torch.testing.assert_close(out, eager(x), rtol=1e-4, atol=1e-5)  # the eager block computes the same
    finally:
        torch._dynamo.reset()  # nothing of this test's caches (nor its spent limit) reaches the next one

_KNOBS = """
import json, os, sys, torch, torch.nn.functional as F
from pipeline.config import load_config
from pipeline.distributed import setup
from pipeline.network import free_port
from pipeline.model import build_vit
from pipeline.train import engine
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
stage = int(sys.argv[1])
cfg = load_config("configs/pretrain/tiny_cpu.yaml", ["data.path=synthetic", f"engine.zero_stage={stage}",
                  "engine.precision=bf16", "train.global_batch=8", "train.micro_batch=4"], world_size=1)
torch.manual_seed(0)
setup(cfg)
eng = engine.build_engine(build_vit(width=16, depth=1, heads=2, mlp_dim=32, patch=4, img_size=8, num_classes=3), cfg)
opt, out = eng.optimizer, {}
overflow_checks = []
if hasattr(opt, "has_overflow"):
    real = opt.has_overflow
    opt.has_overflow = lambda *a, **k: overflow_checks.append(1) or real(*a, **k)
x, y = torch.randn(4, 3, 8, 8, dtype=torch.bfloat16), torch.tensor([0, 1, 2, 0])
for _ in range(2):  # two micro steps = one optimizer step (accumulation 2)
    eng.backward(F.cross_entropy(eng(x).float(), y))
    if not out.get("bf16_grads_after_backward"):
        out["bf16_grads_after_backward"] = sum(p.grad is not None for p in eng.module.parameters())
    eng.step()
# where each optimizer accumulates: BF16_Optimizer's whole buffer, stage 3's partition buffer, stage 2's dtype
flat = getattr(opt, "fp32_groups_gradients_flat", None) or [getattr(opt, "grad_partitions_flat_buffer", None)]
buffer = flat[0].dtype if flat[0] is not None else getattr(opt, "gradient_accumulation_dtype", None)
out.update(optimizer=type(opt).__name__, accum_dtype=str(eng.get_data_types()[1]), buffer_dtype=str(buffer),
           immediate=getattr(opt, "immediate_grad_update", None), check=getattr(opt, "check_grad_overflow", None),
           overflow_checks=len(overflow_checks), norm=engine.grad_norm(eng))
# the consolidated fp32 weights of a saved checkpoint are the optimizer's fp32 master weights, bit for bit
# (bf16 ZeRO-1's BF16_Optimizer files are not read by zero_to_fp32: they go through a universal conversion)
import tempfile
from deepspeed.utils import safe_get_full_fp32_param
with tempfile.TemporaryDirectory() as d:
    engine.save_checkpoint(eng, d, "step-2")
    sd = engine.fp32_state_dict(os.path.join(d, "step-2"))
    out["files"] = sorted(os.listdir(os.path.join(d, "step-2")))
master = {n: safe_get_full_fp32_param(p).detach().float() for n, p in eng.module.named_parameters()}
out["fp32_exact"] = sd.keys() == master.keys() and all(torch.equal(sd[n], master[n]) for n in master)
print("RESULT " + json.dumps(out))
"""


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_knobs_do_what_the_config_says(stage):
    """The generated keys, in a real (1-rank, CPU) DeepSpeed engine: ZeRO-1 bf16 runs BF16_Optimizer with
    an fp32 gradient buffer filled from hooks (no bf16 gradient left after backward); ZeRO-2 never runs
    its overflow check; ZeRO-2/3 keep the gradient partition in fp32. Each stage's checkpoint consolidates
    to its fp32 master weights. One engine per process (DeepSpeed keeps its groups in module globals)."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _KNOBS, str(stage)], capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "DS_ACCELERATOR": "cpu"})
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    r = json.loads(line[-1][len("RESULT "):])
    assert r["accum_dtype"] == "torch.float32" and r["buffer_dtype"] == "torch.float32"
    assert r["norm"] > 0 and r["norm"] == r["norm"]
    assert r["fp32_exact"], r["files"]
    if stage == 1:
        assert r["optimizer"] == "BF16_Optimizer" and r["immediate"] is True
        assert r["bf16_grads_after_backward"] == 0  # each was added to the fp32 buffer and freed in backward
    elif stage == 2:
        assert r["optimizer"] == "DeepSpeedZeroOptimizer" and r["check"] is False and r["overflow_checks"] == 0
    else:
        assert r["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"


_STAGE = """
import json, sys
from launch.cli import main
rc = main(["pretrain", "--config", "configs/pretrain/tiny_cpu.yaml", "run.dir=" + sys.argv[1], "tracking.enabled=false",
           "data.path=synthetic:train=64,val=16", "train.steps=1", "model.depth=1", "model.img_size=16"])
print("RESULT " + json.dumps({"rc": rc, "loaded": sorted(m for m in sys.modules if m in sys.argv[2:])}))
"""


def test_a_stage_loads_only_what_it_runs(tmp_path):
    """A one-step pre-training (ZeRO-2 over gloo, tracking off) in a fresh interpreter leaves out what it
    never runs: mlflow (which `import deepspeed` pulls in for its autotuner), DeepSpeed's shared-memory
    comm op (a C++ extension compiled on first use; only AutoTP inference calls it) and inductor, which
    DeepSpeed's Muon kernels loaded when ZeRO imported them (the module itself loads: ZeRO asks it)."""
    import json
    import os
    import subprocess
    import sys

    unused = ["mlflow", "deepspeed_shm_comm", "torch._inductor.compile_fx"]
    proc = subprocess.run([sys.executable, "-c", _STAGE, str(tmp_path / "run"), *unused,
                           "deepspeed.runtime.zero.muon.muon_optimizer"], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    r = json.loads(line[-1][len("RESULT "):])
    assert r == {"rc": 0, "loaded": ["deepspeed.runtime.zero.muon.muon_optimizer"]}
    assert (tmp_path / "run/model.safetensors").is_file() and (tmp_path / "run/figures").is_dir()
