"""Train-step speed of vitp's ViT vs timm's VisionTransformer with the same config and weights.

One step = forward + cross-entropy + backward + AdamW. All models run in this process, interleaved
(the order rotates every round, so drift in a shared machine's load hits each alike); ratios of the
medians (vitp / timm, < 1 is faster):

  ratio train_step_vs_timm_<config>            vitp as users run it: with the class-token head its last
                                               block computes token 0 only (the logits and gradients
                                               are the same; ~1/depth less work)
  ratio train_step_vs_timm_same_work_<config>  vitp computing every token in every block, as timm does
                                               (like for like: the speed of the same computation)

and the S/16 ones also as the headlines `ratio train_step_vs_timm` and `..._same_work`. Patch dropping
at 0.5 (model.patch_drop; each step draws its kept patches as the training loop does, and that draw
is part of the timed step), in the same interleaved rounds:

  ratio train_step_patchdrop50_vs_full_<config>  vitp at patch_drop=0.5 / vitp at 0 (goal <= 0.60)
  ratio train_step_patchdrop50_vs_timm_<config>  vitp at 0.5 / timm's VisionTransformer(patch_drop_rate=0.5)
                                                 (the same kept-token count; vitp as users run it)
  ratio train_step_patchdrop50_vs_timm_same_work_<config>   vitp computing every kept token in every block

with the S/16 ones also as the headlines `ratio train_step_patchdrop50_vs_full` and `..._vs_timm`.

Each process holds its host allocator steady as a vitp rank does (pipeline/threads.py
steady_allocator; the same for every model in it): with glibc's default, where a step's activation
tensors land (reused heap or fresh, zero-filled pages) depended on the process's allocation history,
so six processes of S/16 once gave train_step_vs_timm from 0.84 to 1.16, and the class-token path
was slower than every token in some. `--default-allocator` measures that default. One process's ratio
is still one sample (thread placement, what else the machine runs), so the interleaved rounds run in
--processes fresh processes (default 3), one after the other; each `ratio` line is the median of their
ratios, and a `# NAME: median M, range LO-HI` line follows it with every process's value.

    python bench/model_step.py                 # S/16 224 px batch 8 and a small config, 2 threads, 3 processes
    python bench/model_step.py --compile       # + torch.compile(vitp) vs eager vitp (small config)
"""

from __future__ import annotations

import argparse
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import timm
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pipeline.model import build_vit, draw_keep, vitp_to_timm  # noqa: E402
from pipeline.threads import steady_allocator  # noqa: E402

PATCH_DROP = 0.5

CONFIGS = {
    # name: (build_vit kwargs, batch)
    "s16": (dict(width=384, depth=12, heads=6, mlp_dim=1536, patch=16, img_size=224,
                 num_classes=1000), 8),
    "small": (dict(width=192, depth=6, heads=3, mlp_dim=768, patch=8, img_size=64,
                   num_classes=100), 16),
}


def timm_twin(cfg: dict, patch_drop_rate: float = 0.0) -> torch.nn.Module:
    return timm.models.vision_transformer.VisionTransformer(
        img_size=cfg["img_size"], patch_size=cfg["patch"], embed_dim=cfg["width"],
        depth=cfg["depth"], num_heads=cfg["heads"], mlp_ratio=cfg["mlp_dim"] / cfg["width"],
        num_classes=cfg["num_classes"], global_pool="token", patch_drop_rate=patch_drop_rate)


class AllTokens(torch.nn.Module):
    """vitp's ViT with the last block computing every token, as timm's does (same logits)."""

    def __init__(self, vit: torch.nn.Module):
        super().__init__()
        self.vit = vit

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        return self.vit.forward_head(self.vit.forward_features(x, first_token_only=False, keep=keep))


def make_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, patch_drop: float = 0.0):
    """One training step of ``model``; with ``patch_drop`` each step draws its kept patches (vitp's
    ``keep`` argument, from a seeded generator, as the training loop does)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05)
    vit = getattr(model, "vit", model)
    gen = torch.Generator().manual_seed(0)

    def forward() -> torch.Tensor:
        if not patch_drop:
            return model(x)
        keep = draw_keep(len(x), vit.patch_grid[0] * vit.patch_grid[1], patch_drop, gen)
        return model(x, keep=keep)

    def step() -> tuple[float, float, int]:
        """(wall seconds, process CPU seconds, page faults) of one step."""
        t0, c0, f0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        loss = torch.nn.functional.cross_entropy(forward(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return (time.perf_counter() - t0, time.process_time() - c0,
                resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)

    return step


def interleaved(steps: dict, rounds: int, warmup: int, raw: dict | None = None) -> dict[str, tuple[float, ...]]:
    """name -> (median wall seconds, median CPU seconds, median page faults) of one step, over ``rounds``
    rounds that each run every step once, in an order rotated by one every round, after ``warmup`` such rounds.
    ``raw``, if given, receives name -> every round's wall seconds."""
    names = list(steps)
    for _ in range(warmup):
        for n in names:
            steps[n]()
    times: dict[str, list] = {n: [] for n in names}
    for i in range(rounds):
        for n in names[i % len(names):] + names[:i % len(names)]:
            times[n].append(steps[n]())
    if raw is not None:
        raw.update({n: [t[0] for t in ts] for n, ts in times.items()})
    return {n: tuple(statistics.median(t[i] for t in ts) for i in range(3)) for n, ts in times.items()}


def spread(raw: dict, num: str, den: str) -> str:
    """Quartiles of the per-round ratios num/den (both ran in the same round): 'q1-q3'."""
    q = statistics.quantiles([a / b for a, b in zip(raw[num], raw[den])], n=4)
    return f"{q[0]:.3f}-{q[2]:.3f}"


def main(argv: list[str] | None = None) -> None:
    """Run ``--processes`` fresh processes of :func:`measure`, one after the other; print the median and
    the range of each ratio over them."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--child", action="store_true")
    a, rest = ap.parse_known_args(argv)
    if a.child or {"-h", "--help"} & set(rest):
        measure(rest)
        return
    if a.processes < 1:
        sys.exit(f"--processes: must be >= 1; got {a.processes}")
    runs: list[dict[str, float]] = []
    for i in range(a.processes):
        r = subprocess.run([sys.executable, __file__, "--child", *rest], capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"bench: process {i + 1} failed: {r.stderr.strip().splitlines()[-1:] or r.returncode}")
        print("\n".join(f"# process {i + 1}: {line[2:]}" for line in r.stdout.splitlines() if line.startswith("# ")),
              flush=True)
        runs.append({k: float(v) for k, v in re.findall(r"^ratio (\S+) (\S+)$", r.stdout, re.M)})
    for name in runs[0]:
        values = [run[name] for run in runs if name in run]
        print(f"ratio {name} {statistics.median(values):.3f}")
        print(f"# {name}: median {statistics.median(values):.3f}, range {min(values):.3f}-{max(values):.3f} "
              f"({len(values)} processes: {' '.join(f'{v:.3f}' for v in values)})", flush=True)


def measure(argv: list[str] | None = None) -> None:
    """One process: the interleaved rounds of every config; one `ratio` line per figure."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--steps", type=int, default=11, help="timed rounds (median); every model runs once a round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--default-allocator", action="store_true",
                    help="leave glibc's allocator at its defaults (a vitp rank holds it steady)")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile(vitp)")
    ap.add_argument("--compile-config", default="small", choices=list(CONFIGS))
    ap.add_argument("--processes", type=int, default=3,
                    help="fresh processes, one after the other (the ratios' median and range)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    steady = not args.default_allocator and steady_allocator()
    print(f"# allocator: {'held steady, as a vitp rank' if steady else 'the default'}")
    for name in args.configs:
        cfg, batch = CONFIGS[name]
        torch.manual_seed(0)
        ours = build_vit(**cfg).train()
        full = build_vit(**cfg).train()
        full.load_state_dict(ours.state_dict())
        full = AllTokens(full)
        ref = timm_twin(ours.config).train()
        ref.load_state_dict(vitp_to_timm(ours.state_dict()))  # same weights, same function
        x = torch.randn(batch, 3, cfg["img_size"], cfg["img_size"])
        y = torch.randint(0, cfg["num_classes"], (batch,))
        with torch.no_grad():  # the three compute the same logits: a ratio compares equal results
            ours.head.weight.normal_()  # zero-initialised: make the check see the features
            full.vit.head.weight.copy_(ours.head.weight)
            ref.head.weight.copy_(ours.head.weight)
            outs = [m(x) for m in (ours, full, ref)]
            diff = max((o - outs[2]).abs().max().item() for o in outs[:2])
        if diff > 1e-3 * outs[2].abs().max().item():
            sys.exit(f"bench: vitp and timm logits differ by {diff:.2e}; the comparison would be unequal")
        # patch dropping: copies with the same weights (each model keeps its own optimizer state)
        ours_pd, full_pd, ref_pd = build_vit(**cfg).train(), build_vit(**cfg).train(), \
            timm_twin(ours.config, PATCH_DROP).train()
        for m in (ours_pd, full_pd):
            m.load_state_dict(ours.state_dict())
        ref_pd.load_state_dict(ref.state_dict())
        full_pd = AllTokens(full_pd)
        t = interleaved({"vitp": make_step(ours, x, y), "vitp_all_tokens": make_step(full, x, y),
                         "timm": make_step(ref, x, y),
                         "vitp_pd": make_step(ours_pd, x, y, PATCH_DROP),
                         "vitp_pd_all_tokens": make_step(full_pd, x, y, PATCH_DROP),
                         "timm_pd": make_step(ref_pd, x, y)}, args.steps, args.warmup, raw := {})
        (t_ours, c_ours, f_ours), (t_full, c_full, f_full), (t_ref, c_ref, f_ref) = \
            t["vitp"], t["vitp_all_tokens"], t["timm"]
        print(f"# {name}: vitp {t_ours * 1e3:.1f} ms  vitp all tokens {t_full * 1e3:.1f} ms  "
              f"timm {t_ref * 1e3:.1f} ms (batch {batch}, median of {args.steps} rounds); "
              f"cpu-time ratios {c_ours / c_ref:.3f}, same work {c_full / c_ref:.3f}; logits agree to {diff:.1e}; "
              f"page faults per step {f_ours:.0f}, {f_full:.0f}, {f_ref:.0f}")
        print(f"ratio train_step_vs_timm_{name} {t_ours / t_ref:.3f}")
        print(f"ratio train_step_vs_timm_same_work_{name} {t_full / t_ref:.3f}")
        (t_pd, c_pd, _), (t_pd_full, c_pd_full, _), (t_ref_pd, c_ref_pd, _) = \
            t["vitp_pd"], t["vitp_pd_all_tokens"], t["timm_pd"]
        print(f"# {name} patch_drop {PATCH_DROP}: vitp {t_pd * 1e3:.1f} ms  vitp all tokens {t_pd_full * 1e3:.1f} ms  "
              f"timm {t_ref_pd * 1e3:.1f} ms; per-round ratio quartiles: vs full {spread(raw, 'vitp_pd', 'vitp')}, "
              f"vs timm {spread(raw, 'vitp_pd', 'timm_pd')}, same work {spread(raw, 'vitp_pd_all_tokens', 'timm_pd')}; "
              f"cpu-time ratios: vs full {c_pd / c_ours:.3f}, vs timm {c_pd / c_ref_pd:.3f}, "
              f"same work {c_pd_full / c_ref_pd:.3f}")
        print(f"ratio train_step_patchdrop50_vs_full_{name} {t_pd / t_ours:.3f}")
        print(f"ratio train_step_patchdrop50_vs_timm_{name} {t_pd / t_ref_pd:.3f}")
        print(f"ratio train_step_patchdrop50_vs_timm_same_work_{name} {t_pd_full / t_ref_pd:.3f}")
        if name == "s16":
            print(f"ratio train_step_vs_timm {t_ours / t_ref:.3f}")
            print(f"ratio train_step_vs_timm_same_work {t_full / t_ref:.3f}")
            print(f"ratio train_step_patchdrop50_vs_full {t_pd / t_ours:.3f}")
            print(f"ratio train_step_patchdrop50_vs_timm {t_pd / t_ref_pd:.3f}")
    if args.compile:
        cfg, batch = CONFIGS[args.compile_config]
        torch.manual_seed(0)
        eager = build_vit(**cfg).train()
        compiled = build_vit(**cfg).train()
        compiled.load_state_dict(eager.state_dict())
        compiled = torch.compile(compiled)
        x = torch.randn(batch, 3, cfg["img_size"], cfg["img_size"])
        y = torch.randint(0, cfg["num_classes"], (batch,))
        t = interleaved({"compiled": make_step(compiled, x, y), "eager": make_step(eager, x, y)}, args.steps,
                        max(args.warmup, 2))  # the first compiled steps include compilation
        (t_c, c_c, _), (t_e, c_e, _) = t["compiled"], t["eager"]
        print(f"# compile ({args.compile_config}): compiled {t_c * 1e3:.1f} ms  "
              f"eager {t_e * 1e3:.1f} ms; cpu-time ratio {c_c / c_e:.3f}")
        print(f"ratio train_step_compiled_vs_eager {t_c / t_e:.3f}")


if __name__ == "__main__":
    main()
