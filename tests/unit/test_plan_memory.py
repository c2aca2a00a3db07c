"""The memory model: hand-checked cases, monotonicity, DeepSpeed's own estimators, autograd's saved tensors."""

from __future__ import annotations

import pytest
import torch

from pipeline.model.vit import build_vit
from pipeline.plan.memory import ModelShape, activation_bytes, buffer_bytes, memory_per_rank, model_states


@pytest.fixture(scope="module")
def shapes():
    # heads sized as in the paper; the pre-training head of the JFT recipes (18291 classes)
    return {v: ModelShape.from_dims(variant=v, num_classes=18291, representation_size=w)
            for v, w in [("vit_b16", 768), ("vit_l16", 1024), ("vit_h14", 1280)]}


def _device(states):
    return sum(v["device"] for v in states.values())


def test_param_count_is_exact_and_matches_paper():
    b16 = ModelShape.from_dims(variant="vit_b16", num_classes=0)
    ref = sum(p.numel() for p in build_vit("vit_b16", num_classes=0).parameters())
    assert b16.params == ref
    assert 85.5e6 < b16.params < 86.5e6  # the paper's "86M"
    assert b16.tokens == 197 and b16.largest_layer == 768 * 3072 + 3072  # fc1 weight + bias


def test_vit_b16_fp32_stage0_is_16_bytes_per_param():
    b16 = ModelShape.from_dims(variant="vit_b16", num_classes=0)
    s = model_states(b16, precision="fp32", zero_stage=0, world_size=8)
    assert _device(s) == 16 * b16.params
    assert s["optimizer"]["device"] == 8 * b16.params


def test_mixed_precision_bytes_per_param(shapes):
    """DeepSpeed's default (gradients accumulate in bf16)."""
    sh, n = shapes["vit_l16"], 8
    P = sh.params
    kw = dict(precision="bf16", world_size=n, grad_accum="bf16")
    assert _device(model_states(sh, zero_stage=0, **kw)) == 20 * P
    # DeepSpeed reduces stage-1 grads into the owned partition unless they must accumulate
    assert _device(model_states(sh, zero_stage=1, **kw)) == pytest.approx(2 * P + 18 * P / n)
    assert _device(model_states(sh, zero_stage=1, accumulation=4, **kw)) == pytest.approx(4 * P + 16 * P / n)
    assert _device(model_states(sh, zero_stage=2, **kw)) == pytest.approx(2 * P + 18 * P / n)
    off = model_states(sh, zero_stage=2, offload_optimizer=True, **kw)
    assert _device(off) == 2 * P
    assert sum(v["host"] for v in off.values()) == pytest.approx(16 * P / n)


def test_fp32_accumulation_bytes_per_param(shapes):
    """vitp's engine (fp32 accumulation): stage 1 bf16 is BF16_Optimizer, a whole fp32 gradient buffer
    (2 + 4 + 12/N) and a 6P all-reduce temporary after backward; stages 2-3 hold the owned gradient
    partition in fp32 and step on it in place (2 + 16/N, 2/N + 16/N + small)."""
    sh, n = shapes["vit_l16"], 8
    P = sh.params
    z1 = memory_per_rank(sh, precision="bf16", zero_stage=1, world_size=n, micro_batch=1)
    assert z1["model_states"] == pytest.approx(6 * P + 12 * P / n)
    assert z1["buffers"]["optimizer_temp"] == 6 * P and z1["buffers"]["grad_bucket"] == 0
    assert _device(model_states(sh, precision="bf16", zero_stage=2, world_size=n)) == pytest.approx(2 * P + 16 * P / n)
    z3 = _device(model_states(sh, precision="bf16", zero_stage=3, world_size=n))
    assert z3 == pytest.approx(18 * (P - sh.small_params) / n + 2 * sh.small_params + 16 * sh.small_params / n)
    # fp32 models are unchanged (accumulating in fp32 is what they did anyway)
    for stage in (0, 1, 2, 3):
        assert model_states(sh, precision="fp32", zero_stage=stage, world_size=n) == \
            model_states(sh, precision="fp32", zero_stage=stage, world_size=n, grad_accum="fp32")


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_plan_counts_the_accumulation_dtype_the_engine_writes(precision):
    from pipeline.config import load_config
    from pipeline.plan.memory import grad_accum_dtype
    from pipeline.train.engine import deepspeed_config

    for stage in (0, 1, 2, 3):
        cfg = load_config("configs/pretrain/tiny_cpu.yaml", ["data.path=synthetic", f"engine.zero_stage={stage}",
                                                            f"engine.precision={precision}"], world_size=2)
        ds = deepspeed_config(cfg, world_size=2)
        assert ds.get("data_types", {}).get("grad_accum_dtype", precision) == grad_accum_dtype(precision, stage)


def test_gradient_buckets_count_the_fp32_reduction(shapes):
    """bf16 model, fp32 reduction, 50M-element reduce buckets (500M at stage 0), overlap_comm on CUDA:
    stages 0 and 2 stage a bf16 bucket and cast it to fp32 for the collective (2 + 4 bytes; stage 2 two
    staging buffers); ZeRO-3's two buckets are fp32."""
    b = lambda stage, prec="bf16": buffer_bytes(shapes["vit_l16"], precision=prec, zero_stage=stage,
                                                world_size=8)["grad_bucket"]
    assert b(0) == (2 + 4) * 500_000_000
    assert b(2) == (2 * 2 + 4) * 50_000_000
    assert b(3) == 2 * 4 * 50_000_000
    assert b(2, "fp32") == 2 * 4 * 50_000_000  # nothing to cast


def test_more_ranks_less_memory_under_zero3_not_under_stage0(shapes):
    sh = shapes["vit_h14"]
    z3 = [memory_per_rank(sh, precision="bf16", zero_stage=3, world_size=n, micro_batch=8)["total"]
          for n in (1, 2, 8, 64)]
    z0 = [memory_per_rank(sh, precision="bf16", zero_stage=0, world_size=n, micro_batch=8)["total"]
          for n in (1, 2, 8, 64)]
    assert all(a > b for a, b in zip(z3, z3[1:]))
    assert len(set(z0)) == 1


def test_checkpointing_and_micro_batch_move_activations(shapes):
    sh = shapes["vit_b16"]
    full = activation_bytes(sh, micro_batch=32, precision="bf16")
    ckpt = activation_bytes(sh, micro_batch=32, precision="bf16", checkpointing=True)
    assert ckpt["peak"] < full["peak"] / 4
    double = activation_bytes(sh, micro_batch=64, precision="bf16")
    assert double["stored"] == pytest.approx(2 * full["stored"])
    math = activation_bytes(sh, micro_batch=32, precision="bf16", attention="math")
    assert math["per_block"] - full["per_block"] == 2 * 32 * 12 * 197 * 197


@pytest.mark.parametrize("variant", ["vit_b16", "vit_l16", "vit_h14"])
@pytest.mark.parametrize("gpus,nodes", [(8, 1), (8, 4)])
def test_model_states_agree_with_deepspeed_estimators(shapes, variant, gpus, nodes):
    """DeepSpeed's estimators count, per parameter, 2 + 18/N bytes at stage 2 and 18/N + 4 x the largest
    layer (its gathered weights and grads) at stage 3. Ours: stage 2 the same; stage 3 20/N (bf16 params
    2 + bf16 grads 2 + fp32 master 4 + fp32 grads during the step 4 + Adam 8), i.e. 2/N more."""
    from deepspeed.runtime.zero import stage3 as s3  # required: a broken install fails, never skips
    from deepspeed.runtime.zero import stage_1_and_2 as s12
    sh, n = shapes[variant], gpus * nodes
    P, live = sh.params, 4 * sh.largest_layer
    for offload in (False, True):
        _, ds2 = s12.estimate_zero2_model_states_mem_needs(P, gpus, nodes, cpu_offload=offload)
        # DeepSpeed's estimators assume its default, gradients accumulated in the model's dtype
        ours2 = _device(model_states(sh, precision="bf16", zero_stage=2, world_size=n, offload_optimizer=offload,
                                     grad_accum="bf16"))
        assert ours2 == pytest.approx(ds2, rel=0.01), (variant, n, offload)
        _, ds3, _ = s3.estimate_zero3_model_states_mem_needs(P, sh.largest_layer, gpus, nodes, cpu_offload=offload,
                                                             cpu_offload_params=False)
        ours3 = _device(model_states(sh, precision="bf16", zero_stage=3, world_size=n, offload_optimizer=offload,
                                     grad_accum="bf16"))
        assert ours3 + live == pytest.approx(ds3, rel=0.03 if offload else 0.12), (variant, n, offload)
    _, ds3p, _ = s3.estimate_zero3_model_states_mem_needs(P, sh.largest_layer, gpus, nodes, cpu_offload=True,
                                                          cpu_offload_params=True)
    ours3p = model_states(sh, precision="bf16", zero_stage=3, world_size=n, offload_optimizer=True,
                          offload_params=True, grad_accum="bf16")
    assert _device(ours3p) + live == pytest.approx(ds3p, rel=0.01)


def _saved_activation_bytes(module, x) -> int:
    """Bytes of the distinct storages autograd saves for backward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_block_activations_match_autograd(dropout):
    torch.manual_seed(0)
    kw = dict(width=64, depth=1, heads=4, mlp_dim=256, patch=4, img_size=32, num_classes=10, dropout=dropout)
    model = build_vit(**kw).train()
    sh = ModelShape.from_dims(**kw)
    B = 3
    x = torch.randn(B, sh.tokens, sh.width, requires_grad=True)
    got = _saved_activation_bytes(model.blocks[0], x)
    want = activation_bytes(sh, micro_batch=B, precision="fp32", dropout=dropout > 0, backend="cpu")["per_block"]
    assert got == want


def test_checkpointed_model_keeps_block_inputs_only():
    torch.manual_seed(0)
    kw = dict(width=64, depth=3, heads=4, mlp_dim=256, patch=4, img_size=32, num_classes=10)
    model = build_vit(**kw).train()
    sh = ModelShape.from_dims(**kw)
    x = torch.randn(2, 3, 32, 32)
    full = _saved_activation_bytes(model, x)
    model.set_grad_checkpointing(True)
    ck = _saved_activation_bytes(model, x)
    plan_full = activation_bytes(sh, micro_batch=2, precision="fp32", backend="cpu")["stored"]
    plan_ck = activation_bytes(sh, micro_batch=2, precision="fp32", backend="cpu", checkpointing=True)["stored"]
    assert plan_full == pytest.approx(full, rel=0.02)  # measured: within 0.2 % and 0.3 %
    assert plan_ck == pytest.approx(ck, rel=0.02)


def test_impossible_inputs_raise():
    sh = ModelShape.from_dims(width=64, depth=1, heads=4, mlp_dim=256, patch=4, img_size=32, num_classes=10)
    with pytest.raises(ValueError, match="world size"):
        model_states(sh, precision="fp32", zero_stage=1, world_size=0)
    with pytest.raises(ValueError, match="micro batch"):
        memory_per_rank(sh, micro_batch=0)
