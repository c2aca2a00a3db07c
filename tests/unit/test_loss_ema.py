"""The training objective and the weight average, against numbers computed by hand: the B/16 recipe's
sigmoid loss (the paper's per-class sigmoid cross-entropy) and EMA's closed form."""

import math

import pytest
import torch

from pipeline.config import load_config
from pipeline.train.ema import Ema
from pipeline.train.loss import loss_fn as train_loss

B16 = "configs/pretrain/vit_b16.yaml"


def loss_fn(cfg, logits, targets):
    """The loss the stage computes for this config."""
    return train_loss(cfg.train.loss, logits, targets, label_smoothing=cfg.data.label_smoothing)


def _bce(z: float, t: float) -> float:
    """-(t log sigmoid(z) + (1 - t) log(1 - sigmoid(z))), written out."""
    return -(t * math.log(1 / (1 + math.exp(-z))) + (1 - t) * math.log(1 - 1 / (1 + math.exp(-z))))


def test_b16_recipe_uses_the_sigmoid_loss_summed_over_classes_averaged_over_images():
    cfg = load_config(B16, ["data.path=synthetic"], world_size=64)
    assert cfg.train.loss == "sigmoid"
    logits = torch.tensor([[2.0, -1.0, 0.0, 0.5], [0.5, 0.5, -3.0, 1.0]])
    labels = torch.tensor([0, 2])
    want = sum(_bce(z, float(k == y)) for row, y in zip(logits.tolist(), labels.tolist())
               for k, z in enumerate(row)) / 2
    assert loss_fn(cfg, logits, labels).item() == pytest.approx(want, rel=1e-6)  # 3.7155...
    soft = torch.tensor([[0.7, 0.0, 0.3, 0.0], [0.0, 0.5, 0.5, 0.0]])  # mixup targets
    want_soft = sum(_bce(z, t) for zr, tr in zip(logits.tolist(), soft.tolist()) for z, t in zip(zr, tr)) / 2
    assert loss_fn(cfg, logits, soft).item() == pytest.approx(want_soft, rel=1e-6)
    # the zero-initialised head: every class at logit 0 costs ln 2, whatever the label
    assert loss_fn(cfg, torch.zeros(3, 10), torch.tensor([1, 4, 9])).item() == pytest.approx(10 * math.log(2))


def test_softmax_loss_with_soft_targets_is_cross_entropy():
    cfg = load_config(B16, ["data.path=synthetic", "train.loss=softmax"], world_size=64)
    logits = torch.tensor([[2.0, -1.0, 0.0], [0.5, 0.5, -3.0]])
    soft = torch.tensor([[0.6, 0.4, 0.0], [0.0, 0.0, 1.0]])
    lse = [math.log(sum(math.exp(z) for z in row)) for row in logits.tolist()]
    want = (0.6 * (lse[0] - 2.0) + 0.4 * (lse[0] + 1.0) + (lse[1] + 3.0)) / 2
    assert loss_fn(cfg, logits, soft).item() == pytest.approx(want, rel=1e-6)
    assert loss_fn(cfg, logits, torch.tensor([0, 2])).item() == pytest.approx(((lse[0] - 2.0) + (lse[1] + 3.0)) / 2)


def test_ema_after_n_updates_equals_the_closed_form():
    """ema_n = d^n p_0 + (1 - d) sum_t d^(n - t) p_t, with p_t the weights after optimizer step t."""
    d, n = 0.9, 7
    lin = torch.nn.Linear(3, 2)
    seq = [torch.randn(2, 3, generator=torch.Generator().manual_seed(t)) for t in range(n + 1)]
    c = torch.tensor([0.5, -2.0])
    with torch.no_grad():
        lin.weight.copy_(seq[0])
        lin.bias.zero_()
    ema = Ema(lin, d)
    for t in range(1, n + 1):
        with torch.no_grad():
            lin.weight.copy_(seq[t])
            lin.bias.copy_(c)
        ema.update(lin)
    want = d ** n * seq[0].double() + (1 - d) * sum(d ** (n - t) * seq[t].double() for t in range(1, n + 1))
    got = ema.state_dict()["weight"]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    # from 0, a constant weight c: ema_n = (1 - d^n) c  (0.5217 c for 0.9 and 7)
    torch.testing.assert_close(ema.state_dict()["bias"], (1 - d ** n) * c, rtol=1e-6, atol=1e-7)


def test_ema_resumed_from_its_state_continues_bit_exactly():
    d = 0.75
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4).to(torch.bfloat16)  # the average is kept in fp32 whatever the weights are
    steps = [torch.randn(4, 4).to(torch.bfloat16) for _ in range(6)]
    whole = Ema(lin, d)
    for w in steps[:3]:
        lin.weight.data.copy_(w)
        whole.update(lin)
    resumed = Ema(lin, d)
    resumed.load_state_dict({k: v.clone() for k, v in whole.state_dict().items()})
    for w in steps[3:]:
        lin.weight.data.copy_(w)
        whole.update(lin)
        resumed.update(lin)
    for k, v in whole.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, resumed.state_dict()[k]), k
    with pytest.raises(ValueError, match="checkpoint EMA lacks"):
        resumed.load_state_dict({"weight": whole.state_dict()["weight"]})


def test_ema_applied_puts_the_average_in_and_the_training_weights_back_bit_exactly():
    """Evaluators see the exported (averaged) weights; training goes on with its own, unchanged."""
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    ema = Ema(net, decay=0.5)
    with torch.no_grad():
        net.weight.add_(1.0)
    ema.update(net)
    before = [p.detach().clone() for p in net.parameters()]
    x = torch.randn(4, 3)
    with ema.applied(net):
        inside = net(x)
        assert all(torch.equal(p, v) for p, v in zip(net.parameters(), ema.values))
    assert torch.allclose(inside, torch.nn.functional.linear(x, ema.values[0], ema.values[1]))
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))
    with pytest.raises(RuntimeError), ema.applied(net):  # put back also when the evaluation fails
        raise RuntimeError("evaluator died")
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))


def test_ema_loaded_from_the_cpu_stays_on_its_parameters_device():
    """A checkpoint is read with map_location="cpu"; the averages must stay where the parameters are
    (a CUDA run would otherwise mix devices in the next update). The meta device stands for CUDA."""
    net = torch.nn.Linear(3, 2, device="meta").to(torch.bfloat16)
    ema = Ema(net, 0.9)
    assert {v.device.type for v in ema.values} == {"meta"}
    ema.load_state_dict({"weight": torch.ones(2, 3), "bias": torch.zeros(2)})
    assert {v.device.type for v in ema.values} == {"meta"} and {v.dtype for v in ema.values} == {torch.float32}
    ema.update(net)  # same device on both sides
    with pytest.raises(ValueError, match=r"checkpoint EMA 'weight' has shape \(3, 3\), the model \(2, 3\)"):
        ema.load_state_dict({"weight": torch.ones(3, 3), "bias": torch.zeros(2)})


def test_ema_is_saved_once_for_all_ranks():
    assert Ema(torch.nn.Linear(2, 2), 0.9).checkpoint_scope == "shared"


def test_ema_update_of_bf16_weights_allocates_nothing_and_equals_the_widened_lerp():
    """bf16 parameters (DeepSpeed's module) widen through the scratch, several groups when it is small;
    the result is what lerp against each parameter's fp32 copy gives, bit for bit, with no allocation."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    net[1].float()
    net[0].to(torch.bfloat16), net[2].to(torch.bfloat16)  # mixed, as a model with fp32 norms would be
    ema = Ema(net, 0.75, scratch_bytes=4 * 130)  # 128 + 16 floats > 130: two groups
    assert ema.groups == [[0], [1, 4, 5]] and ema.wide == [2, 3]
    want = [v.clone() for v in ema.values]
    for _ in range(3):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p.float()).to(p.dtype))
        torch._foreach_lerp_(want, [p.detach().float() for p in net.parameters()], 0.25)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            ema.update(net)
        assert [e.name for e in prof.events() if e.cpu_memory_usage > 0] == []
    assert all(torch.equal(v, w) for v, w in zip(ema.values, want))
