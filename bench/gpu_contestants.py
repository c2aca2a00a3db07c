"""The contestants of bench/gpu_step.py: each builder returns (step, close); ``step()`` is one
optimizer step on a fixed batch (uint8 images on the device -> normalize -> forward -> loss ->
backward -> optimizer), ``close()`` frees what it holds.

    vitp       vitp's DeepSpeed engine (pipeline.train.engine.build_engine) as the loop drives it
    vitp_full  the same with every token through the last block (timm's work)
    plain      the same vitp model (blocks compiled alike) in a plain torch loop, no DeepSpeed
    timm       timm's VisionTransformer with vitp's dims in the plain loop, its blocks compiled as vitp's
               are (train.compile: each block torch.compile'd in place), so compiled meets compiled

vitp's ``step`` also takes a batch (uint8 images, labels on the device) in place of the fixed one: the
loader-fed measurement of bench/gpu_step.py.

The caller has set up the process group (pipeline.distributed.setup) before it builds a vitp engine.
"""

from __future__ import annotations

import types

import torch

from pipeline.data.loader import normalize
from pipeline.train import engine as eng
from pipeline.train.loss import loss_fn
from pipeline.weights import build_model


def _full_forward(self, x):
    """ViT.forward with every token through the last block (timm's work), instead of token 0 only."""
    return self.forward_head(self.forward_features(x))


def _vitp_model(cfg, num_classes: int, device):
    torch.manual_seed(cfg.seed)
    with torch.device(device):  # initialised where it trains: no host copy of a 300M-parameter model
        return build_model(cfg, num_classes)


def build_vitp(cfg, images, labels, num_classes, device, *, full_last_block=False):
    """The pre-training step: DeepSpeed engine from pipeline.train.engine.build_engine, as the loop drives it."""
    model = _vitp_model(cfg, num_classes, device)
    if full_last_block:
        model.forward = types.MethodType(_full_forward, model)
    engine = eng.build_engine(model, cfg)
    dtype, kind, lr = eng.input_dtype(cfg), cfg.train.loss, cfg.optim.lr
    engine.train()

    def step(x=images, y=labels):
        eng.set_lr(engine, lr)
        logits = engine(normalize(x).to(dtype)).float()
        engine.backward(loss_fn(kind, logits, y))
        engine.step()

    def close():
        if hasattr(engine, "destroy"):  # removes ZeRO's gradient hooks, frees its buffers
            engine.destroy()

    return step, close


def _plain_loop(model, cfg, images, labels, device):
    """A plain torch loop: bf16 autocast (on CUDA with precision bf16), fused AdamW, the recipe's clip."""
    o = cfg.optim
    groups = eng.default_param_groups(model, o.weight_decay)
    params = [p for g in groups for p in g["params"]]
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                            fused=True if device.type == "cuda" else None)
    amp = device.type == "cuda" and cfg.engine.precision == "bf16"
    kind, clip = cfg.train.loss, cfg.optim.clip_grad
    model.train()

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(normalize(images))
        loss_fn(kind, logits.float(), labels).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, lambda: None


def build_plain(cfg, images, labels, num_classes, device):
    """The same vitp model (blocks compiled as the engine compiles them) without DeepSpeed."""
    model = _vitp_model(cfg, num_classes, device)
    eng.compile_blocks(model, cfg)
    return _plain_loop(model, cfg, images, labels, device)


def build_timm(cfg, images, labels, num_classes, device):
    """timm's VisionTransformer with vitp's dims, class token and dropout (timm has no pre-logits layer:
    vitp's extra D x R matmul on the class token is < 0.1% of the FLOPs); its blocks compiled where
    ``cfg`` compiles vitp's, by the same function."""
    from timm.models.vision_transformer import VisionTransformer

    with torch.device("meta"):
        c = build_model(cfg, num_classes).config
    torch.manual_seed(cfg.seed)
    with torch.device(device):
        model = VisionTransformer(
            img_size=c["img_size"], patch_size=c["patch"], embed_dim=c["width"], depth=c["depth"],
            num_heads=c["heads"], mlp_ratio=c["mlp_dim"] / c["width"], num_classes=num_classes,
            global_pool="token", class_token=True, pos_drop_rate=c["dropout"], proj_drop_rate=c["dropout"],
            attn_drop_rate=c["attn_dropout"], drop_path_rate=c["drop_path"])
    eng.compile_blocks(model, cfg)
    return _plain_loop(model, cfg, images, labels, device)


BUILDERS = {"vitp": build_vitp, "vitp_full": lambda *a: build_vitp(*a, full_last_block=True), "plain": build_plain,
            "timm": build_timm}
