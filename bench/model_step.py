"""Train-step speed of vitp's ViT vs timm's VisionTransformer with the same config and weights.

One step = forward + cross-entropy + backward + AdamW. Both models run in this process, alternating
A/B (and swapping the order every round, so drift in a shared machine's load hits both alike);
the ratio of the medians is printed as `ratio train_step_vs_timm_<config> VALUE` (vitp / timm, < 1
is faster), the S/16 one also as the headline `ratio train_step_vs_timm`.

    python bench/model_step.py                 # S/16 224 px batch 8 and a small config, 2 threads
    python bench/model_step.py --compile       # + torch.compile(vitp) vs eager vitp (small config)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import timm
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pipeline.model import build_vit, vitp_to_timm  # noqa: E402

CONFIGS = {
    # name: (build_vit kwargs, batch)
    "s16": (dict(width=384, depth=12, heads=6, mlp_dim=1536, patch=16, img_size=224,
                 num_classes=1000), 8),
    "small": (dict(width=192, depth=6, heads=3, mlp_dim=768, patch=8, img_size=64,
                   num_classes=100), 16),
}


def timm_twin(cfg: dict) -> torch.nn.Module:
    return timm.models.vision_transformer.VisionTransformer(
        img_size=cfg["img_size"], patch_size=cfg["patch"], embed_dim=cfg["width"],
        depth=cfg["depth"], num_heads=cfg["heads"], mlp_ratio=cfg["mlp_dim"] / cfg["width"],
        num_classes=cfg["num_classes"], global_pool="token")


def make_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05)

    def step() -> tuple[float, float]:
        """(wall seconds, process CPU seconds) of one step."""
        t0, c0 = time.perf_counter(), time.process_time()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, time.process_time() - c0

    return step


def ab(step_a, step_b, steps: int, warmup: int) -> tuple[float, float, float]:
    """Median wall seconds of A and B, interleaved ABBA... after `warmup` rounds of both, and the
    ratio of median CPU seconds (a cross-check when the shared machine is oversubscribed)."""
    for _ in range(warmup):
        step_a(), step_b()
    ta, tb = [], []
    for i in range(steps):
        if i % 2 == 0:
            ta.append(step_a()), tb.append(step_b())
        else:
            tb.append(step_b()), ta.append(step_a())
    med = lambda ts, i: statistics.median(t[i] for t in ts)
    return med(ta, 0), med(tb, 0), med(ta, 1) / med(tb, 1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--steps", type=int, default=5, help="timed steps per model (median)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile(vitp)")
    ap.add_argument("--compile-config", default="small", choices=list(CONFIGS))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    for name in args.configs:
        cfg, batch = CONFIGS[name]
        torch.manual_seed(0)
        ours = build_vit(**cfg).train()
        ref = timm_twin(ours.config).train()
        ref.load_state_dict(vitp_to_timm(ours.state_dict()))  # same weights, same work
        x = torch.randn(batch, 3, cfg["img_size"], cfg["img_size"])
        y = torch.randint(0, cfg["num_classes"], (batch,))
        t_ours, t_ref, cpu = ab(make_step(ours, x, y), make_step(ref, x, y), args.steps,
                                args.warmup)
        print(f"# {name}: vitp {t_ours * 1e3:.1f} ms  timm {t_ref * 1e3:.1f} ms  (batch {batch}, "
              f"median of {args.steps}); cpu-time ratio {cpu:.3f}")
        print(f"ratio train_step_vs_timm_{name} {t_ours / t_ref:.3f}")
        if name == "s16":
            print(f"ratio train_step_vs_timm {t_ours / t_ref:.3f}")
    if args.compile:
        cfg, batch = CONFIGS[args.compile_config]
        torch.manual_seed(0)
        eager = build_vit(**cfg).train()
        compiled = build_vit(**cfg).train()
        compiled.load_state_dict(eager.state_dict())
        compiled = torch.compile(compiled)
        x = torch.randn(batch, 3, cfg["img_size"], cfg["img_size"])
        y = torch.randint(0, cfg["num_classes"], (batch,))
        t_c, t_e, cpu = ab(make_step(compiled, x, y), make_step(eager, x, y), args.steps,
                      max(args.warmup, 2))  # the first compiled steps include compilation
        print(f"# compile ({args.compile_config}): compiled {t_c * 1e3:.1f} ms  "
              f"eager {t_e * 1e3:.1f} ms; cpu-time ratio {cpu:.3f}")
        print(f"ratio train_step_compiled_vs_eager {t_c / t_e:.3f}")


if __name__ == "__main__":
    main()
