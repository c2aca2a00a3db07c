"""vitp's pre-training step on one GPU, side by side with its peers in one process; prints ratios.

    mfu_vit_l16               vitp's step (pipeline.train.engine.build_engine, configs/pretrain/vit_l16.yaml for
                              1 rank: ZeRO-2, bf16) at the best micro batch: model FLOPs / (step time x peak)
    mfu_vit_b16               the same for vit_b16.yaml
    step_vs_timm_gpu          vitp step time / timm VisionTransformer in a plain torch loop (bf16 autocast,
                              fused AdamW, same clip and loss), same batch, SAME WORK: every token through
                              vitp's last block, as in timm's; timm's blocks compiled as vitp's are (each
                              torch.compile'd in place), so compiled meets compiled
    step_vs_timm_gpu_eager    the same with neither compiled (with --compile off: the line above again)
    step_vs_timm_gpu_token0   the same as step_vs_timm_gpu with vitp as it trains (last block: token 0 only)
    zero2_vs_plain_gpu        DeepSpeed throughput / the same vitp model in a plain torch loop, same batch
    loader_vs_step_gpu        TrainLoader images/s over `vitp prep` shards (os.cpu_count() workers, pinned,
                              copied and normalised on the device) / ViT-L/16 training images/s
    data_wait_vit_l16_gpu     vitp's step fed by that loader as the training loop feeds it: the share of the
                              windows' wall time spent waiting for the next batch (the training records'
                              data_wait: host clocks around the loader's next(), no device sync per step)
    plan_vs_measured_mem_gpu  `vitp plan` peak memory per GPU / torch.cuda.max_memory_allocated, ViT-L/16
    mfu_vit_l16_recipe        vitp's step as the recipe runs it: its micro batch, its accumulation (global batch /
                              (world x micro batch) on --resources' cluster), its ZeRO stage; one optimizer step
    zero1_vs_zero2_gpu        at that micro batch and accumulation: ZeRO-2 step time / ZeRO-1 step time (above 1:
                              ZeRO-1 is faster; ZeRO-2 reduces every micro step and syncs after each backward)

A step is the loop's: uint8 batch on the device -> normalize -> forward -> loss -> backward -> optimizer.
Step time: median of --windows windows of --steps steps after --warmup, synchronised around each window.
The peers run on the first of --models at its best batch (or the largest smaller one where all fit).
Ratio lines go to stdout, everything else to stderr. Tracking is off (no MLflow needed).

    python bench/gpu_step.py                  # one GPU, ~6 minutes on an H100
    python bench/gpu_step.py --compile off    # vitp without torch.compile'd blocks
    python bench/gpu_step.py --smoke          # every path on the CPU: tiny ViT, 1-2 steps, fp32, gloo
    python bench/gpu_step.py --models vit_b16 --batches 128,256 --sections search   # make gpu-check's part
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_contestants import BUILDERS  # noqa: E402
from bench.gpu_loader import LoaderSections, write_images  # noqa: E402, F401 (write_images: gpu_check's)
from pipeline.config import load_config  # noqa: E402
from pipeline.distributed import setup  # noqa: E402
from pipeline.model.flops import train_step_flops  # noqa: E402
from pipeline.weights import build_model  # noqa: E402

BATCHES = {"vit_l16": [32, 64, 128, 256], "vit_b16": [64, 128, 256, 512]}
SMOKE_BATCHES = [2, 4]
# a tiny ViT for --smoke (explicit dims override the recipe's variant)
SMOKE_MODEL = ["model.width=32", "model.depth=2", "model.heads=2", "model.mlp_dim=64", "model.patch=8",
               "model.img_size=32", "model.representation_size=32"]
PEAKS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # bf16 dense FLOP/s (H100: the SXM figure)
GiB = 2**30


@dataclass
class Timing:
    step_s: float  # median seconds per step
    peak_bytes: float  # torch.cuda.max_memory_allocated over the timed windows (nan on CPU)
    windows: list


OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
RATIOS = sys.stdout  # the ratio lines; everything else printed while the bench runs goes to stderr


T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def ratio(name: str, value: float) -> None:
    print(f"ratio {name} {value:.4f}", file=RATIOS, flush=True)


# --------------------------------------------------------------------------------------------------
# The bench
# --------------------------------------------------------------------------------------------------
class Bench(LoaderSections):
    def __init__(self, args):
        self.args = args
        self.cuda = not args.smoke
        if self.cuda and not torch.cuda.is_available():
            from pipeline.distributed import cuda_problem

            raise SystemExit(f"error: no usable CUDA GPU ({cuda_problem()}); --smoke runs the CPU paths")
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.compile = {"auto": None, "on": True, "off": False}[args.compile]
        self.num_classes = args.classes

    @property
    def compiling(self) -> bool:
        return self.cuda and self.compile is not False

    log = staticmethod(log)

    def elapsed(self) -> float:
        return time.perf_counter() - T0

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def cfg(self, name: str, batch: int, accum: int = 1, zero: int | None = None, ckpt: bool = False,
            compile: bool | None = None):
        """The recipe overridden for one rank at micro batch ``batch`` x ``accum`` micro steps per optimizer step
        (``compile``: train.compile, default the bench's --compile)."""
        a = self.args
        compile = self.compile if compile is None else compile
        ov = [f"train.micro_batch={batch}", f"train.global_batch={batch * accum}", "cluster.nodes=1",
              "cluster.tasks_per_node=1", f"cluster.gpus_per_node={int(self.cuda)}",
              f"engine.zero_stage={a.zero if zero is None else zero}",
              f"engine.precision={'bf16' if self.cuda else 'fp32'}",
              f"engine.backend={'nccl' if self.cuda else 'gloo'}",
              "tracking.enabled=false", f"model.num_classes={self.num_classes}",
              f"model.grad_checkpointing={str(ckpt).lower()}"]
        if compile is not None:
            ov.append(f"train.compile={str(compile).lower()}")
        if a.smoke:
            ov += SMOKE_MODEL
        return load_config(ROOT / "configs" / "pretrain" / f"{name}.yaml", ov, world_size=1)

    def batch(self, cfg, b: int):
        """A synthetic uint8 batch already on the device (the loader is measured on its own)."""
        g = torch.Generator().manual_seed(b)
        s = cfg.model.img_size
        images = torch.randint(0, 256, (b, 3, s, s), dtype=torch.uint8, generator=g).to(self.device)
        labels = torch.randint(0, self.num_classes, (b,), generator=g).to(self.device)
        return images, labels

    def time_steps(self, step) -> Timing:
        a = self.args
        for _ in range(a.warmup):
            step()
        self.sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        windows = []
        for _ in range(a.windows):
            self.sync()
            t = time.perf_counter()
            for _ in range(a.steps):
                step()
            self.sync()
            windows.append((time.perf_counter() - t) / a.steps)
        peak = float(torch.cuda.max_memory_allocated()) if self.cuda else math.nan
        return Timing(statistics.median(windows), peak, windows)

    def measure(self, kind: str, cfg, b: int) -> Timing | None:
        """Build ``kind`` at micro batch ``b``, time it, free it; None if it does not fit in memory."""
        self.free()
        if self.cuda:
            log(f"  {kind} b={b}: {torch.cuda.memory_allocated() / GiB:.2f} GiB allocated before building")
        try:
            return self._measure(kind, cfg, b)
        except (OOM, RuntimeError) as e:
            if not isinstance(e, OOM) and "out of memory" not in str(e).lower():
                raise
            log(f"  {kind} b={b}: out of memory ({str(e).splitlines()[0][:120]})")
        finally:
            self.free()  # this frame holds nothing of the contestant: its memory goes back here
        return None

    def _measure(self, kind: str, cfg, b: int) -> Timing:
        images, labels = self.batch(cfg, b)
        micro, close = BUILDERS[kind](cfg, images, labels, self.num_classes, self.device)
        accum = cfg.train.global_batch // cfg.train.micro_batch

        def step():  # one optimizer step: DeepSpeed steps the optimizer at the accumulation boundary
            for _ in range(accum):
                micro()

        try:
            return self.time_steps(step)
        finally:
            close()

    def measure_vitp(self, name: str, b: int, kind: str = "vitp") -> Timing | None:
        """As measure() for vitp's model; if compiling its blocks fails, say so loudly and go on without."""
        try:
            return self.measure(kind, self.cfg(name, b), b)
        except Exception:
            if self.compile is False:
                raise
            log("vitp FAILED with train.compile on; retrying everything with train.compile=false:\n"
                + traceback.format_exc())
            self.compile = False
            torch._dynamo.reset()
            return self.measure(kind, self.cfg(name, b), b)

    def peak(self, cfg) -> tuple[float, str]:
        if not self.cuda:
            return cfg.hardware.peak_tflops * 1e12, "hardware.peak_tflops of the recipe (CPU smoke: not a real peak)"
        dev = torch.cuda.get_device_name()
        for key, flops in PEAKS.items():
            if key in dev:
                return flops, f"{flops / 1e12:.0f} TFLOP/s bf16 dense for {key} ({dev})"
        hw = cfg.hardware.peak_tflops
        return hw * 1e12, f"hardware.peak_tflops {hw:g} of the recipe ({dev} is not in this bench's table)"

    def plan_bytes(self, cfg) -> float:
        from pipeline.plan.cost import plan

        return float(plan(cfg, num_classes=self.num_classes, backend="cuda" if self.cuda else "cpu")["memory"]["total"])

    def flops(self, cfg, b: int) -> float:
        with torch.device("meta"):
            c = build_model(cfg, self.num_classes).config
        return float(train_step_flops(c, batch=b, grad_checkpointing=False))

    # ---- sections ----------------------------------------------------------------------------------
    def search(self, name: str, budget_s: float) -> dict[int, Timing]:
        """vitp's step at each candidate micro batch, largest first (the likeliest best; one that does not
        fit falls through to the next), smaller ones while the time budget lasts."""
        batches = SMOKE_BATCHES if self.args.smoke else (self.args.batches or BATCHES.get(name, [32, 64, 128, 256]))
        total = torch.cuda.get_device_properties(self.device).total_memory if self.cuda else math.inf
        out: dict[int, Timing] = {}
        steps = self.args.warmup + self.args.windows * self.args.steps
        for b in sorted(batches, reverse=True):
            if out:  # a smaller one costs its steps, building, and at the second size a dynamic-batch recompile
                last = min(out)
                est = steps * out[last].step_s * b / last + 15 + (45 if self.compiling and len(out) == 1 else 0)
                if self.elapsed() + est > budget_s:
                    log(f"{name}: b={b} would end past the time budget ({budget_s:.0f}s); not tried")
                    break
            cfg = self.cfg(name, b)
            planned = self.plan_bytes(cfg)
            if planned > 1.15 * total:
                log(f"{name} b={b}: the plan says {planned / GiB:.1f} GiB > {total / GiB:.1f} GiB; not tried")
                continue
            r = self.measure_vitp(name, b)
            if r is None:
                continue
            out[b] = r
            peak, _ = self.peak(cfg)
            log(f"{name} b={b}: {r.step_s * 1e3:.1f} ms/step, {b / r.step_s:.1f} img/s, "
                f"MFU {self.flops(cfg, b) / r.step_s / peak:.3f}, max allocated {r.peak_bytes / GiB:.2f} GiB, "
                f"plan {planned / GiB:.2f} GiB; windows " + " ".join(f"{w * 1e3:.1f}" for w in r.windows))
        return out

    def compare(self, name: str, found: dict[int, Timing], best: int) -> None:
        """timm and the plain loop vs vitp at the largest batch <= best where every contestant fits; timm's
        blocks compiled as vitp's are, and (when compiling) both once more uncompiled."""
        if self.compiling:  # static graphs for this batch, as a run at one micro batch has (cached on disk)
            torch._dynamo.reset()
        for b in sorted((b for b in found if b <= best), reverse=True):
            got = {}
            for kind in ("vitp_full", "timm", "plain"):  # vitp first: a failed compile turns it off for all
                got[kind] = self.measure(kind, self.cfg(name, b), b) if kind == "timm" else \
                    self.measure_vitp(name, b, kind)
                if got[kind] is None:
                    break
            if any(v is None for v in got.values()):
                continue
            eager = self.eager_pair(name, b) if self.compiling else (got["vitp_full"], got["timm"])
            ds = found[b]
            log(f"compared at b={b} on {name}, ms/step: vitp (DeepSpeed ZeRO-{self.args.zero}) {ds.step_s * 1e3:.1f} "
                f"(token 0 in the last block), {got['vitp_full'].step_s * 1e3:.1f} (every token); timm "
                f"{got['timm'].step_s * 1e3:.1f}; plain vitp {got['plain'].step_s * 1e3:.1f}; train.compile "
                f"{self.compiling} for all; uncompiled: vitp (every token) / timm "
                + " / ".join(f"{r.step_s * 1e3:.1f}" if r else "did not fit" for r in eager)
                + "; max allocated GiB: " + ", ".join(f"{k} {r.peak_bytes / GiB:.2f}" for k, r in got.items()))
            ratio("step_vs_timm_gpu", got["vitp_full"].step_s / got["timm"].step_s)
            ratio("step_vs_timm_gpu_eager", eager[0].step_s / eager[1].step_s if all(eager) else math.nan)
            ratio("step_vs_timm_gpu_token0", ds.step_s / got["timm"].step_s)
            ratio("zero2_vs_plain_gpu", got["plain"].step_s / ds.step_s)
            return
        log(f"{name}: timm / plain loop fit at no measured batch")
        for n in ("step_vs_timm_gpu", "step_vs_timm_gpu_eager", "step_vs_timm_gpu_token0", "zero2_vs_plain_gpu"):
            ratio(n, math.nan)

    def eager_pair(self, name: str, b: int) -> tuple[Timing | None, Timing | None]:
        """vitp (every token through the last block) and timm at micro batch ``b``, neither compiled."""
        cfg = self.cfg(name, b, compile=False)
        return self.measure("vitp_full", cfg, b), self.measure("timm", cfg, b)

    def run(self) -> None:
        a = self.args
        models = a.models.split(",")
        cfg0 = self.cfg(models[0], 1)
        setup(cfg0)  # the 1-rank group every engine below reuses
        if self.compiling:
            for key in ("cache_size_limit", "recompile_limit"):  # batch sizes x last-block variants
                if hasattr(torch._dynamo.config, key):
                    setattr(torch._dynamo.config, key, max(64, getattr(torch._dynamo.config, key)))
        peak, peak_note = self.peak(cfg0)
        log(f"device {self.device} ({torch.cuda.get_device_name() if self.cuda else 'CPU smoke'}); peak {peak_note}; "
            f"ZeRO-{a.zero}, {cfg0.engine.precision}, train.compile={self.compile} (None: the config's default), "
            f"{self.num_classes} classes, {a.warmup} warm-up + {a.windows} x {a.steps} timed steps")
        for i, name in enumerate(models):
            share = (0.55 if len(models) > 1 else 0.8) if i == 0 and a.sections == "all" else 1.0
            if i and self.compiling:
                torch._dynamo.reset()  # another width: fresh static graphs, not ones made dynamic in every dim
            try:
                found = self.search(name, budget_s=a.budget_s * share)
            except Exception:
                log(f"{name}: FAILED\n{traceback.format_exc()}")
                found = {}
            best = max(found, key=lambda b: b / found[b].step_s) if found else None
            if best is None:
                ratio(f"mfu_{name}", math.nan)
            else:
                log(f"{name}: best micro batch {best}: {best / found[best].step_s:.1f} img/s")
                ratio(f"mfu_{name}", self.flops(self.cfg(name, best), best) / found[best].step_s / peak)
            if i == 0 and a.sections == "all":
                self.against_peers(name, found, best)
                self.at_recipe(name)
        log(f"done in {self.elapsed():.0f}s")

    def at_recipe(self, name: str) -> None:
        """The step as the recipe runs it (micro batch, accumulation, activation checkpointing), under ZeRO-1
        and ZeRO-2 side by side, interleaved twice so drift on a shared machine hits both alike."""
        mb, accum, zero, ckpt = recipe_step(name, self.args.resources)
        if self.args.smoke:
            mb, accum = SMOKE_BATCHES[0], 2  # the accumulation path, on a CPU
        if self.args.accum:
            accum = self.args.accum
        log(f"{name} as the recipe runs: micro batch {mb} x accumulation {accum}, ZeRO-{zero}, activation "
            f"checkpointing {'on' if ckpt else 'off'}; timing ZeRO-1 and ZeRO-2 there")
        got: dict[int, list[float]] = {1: [], 2: []}
        try:
            for _ in range(2):
                for z in (1, 2):
                    r = self.measure("vitp", self.cfg(name, mb, accum, z, ckpt), mb)
                    if r is None:
                        raise RuntimeError(f"ZeRO-{z} at micro batch {mb} does not fit")
                    got[z].append(r.step_s)
            t1, t2 = statistics.median(got[1]), statistics.median(got[2])
            own = {1: t1, 2: t2}.get(zero)
            log(f"{name} recipe step: ZeRO-1 {t1 * 1e3:.1f} ms, ZeRO-2 {t2 * 1e3:.1f} ms per optimizer step")
            peak, _ = self.peak(self.cfg(name, mb))
            flops = self.flops(self.cfg(name, mb), mb) * accum
            ratio(f"mfu_{name}_recipe", flops / own / peak if own else math.nan)  # ZeRO-3 recipes: see --zero
            ratio("zero1_vs_zero2_gpu", t2 / t1)
        except Exception:
            log(f"FAILED: mfu_{name}_recipe, zero1_vs_zero2_gpu\n{traceback.format_exc()}")
            ratio(f"mfu_{name}_recipe", math.nan)
            ratio("zero1_vs_zero2_gpu", math.nan)
            self.free()

    def against_peers(self, name: str, found: dict[int, Timing], best: int | None) -> None:
        """The first model's comparisons: timm and the plain loop, the loader, the plan's memory."""
        sections = {"peers": ("step_vs_timm_gpu", "step_vs_timm_gpu_eager", "step_vs_timm_gpu_token0",
                              "zero2_vs_plain_gpu"),
                    "loader": ("loader_vs_step_gpu",), "data_wait": (f"data_wait_{name}_gpu",),
                    "memory": ("plan_vs_measured_mem_gpu",)}
        for section, names in sections.items():
            try:
                if best is None:
                    raise RuntimeError(f"{name}: no micro batch was measured")
                if section == "peers":
                    self.compare(name, found, best)
                elif section == "loader":
                    train_rate = best / found[best].step_s
                    ratio("loader_vs_step_gpu", self.loader_rate(self.cfg(name, best), best) / train_rate)
                elif section == "data_wait":
                    ratio(f"data_wait_{name}_gpu", self.data_wait(name, best))
                else:
                    self.memory(name, best, found[best])
            except Exception:
                log(f"FAILED: {', '.join(names)}\n{traceback.format_exc()}")
                for n in names:
                    ratio(n, math.nan)
                self.free()

    def memory(self, name: str, best: int, r: Timing) -> None:
        from pipeline.plan.memory import CUDA_CONTEXT

        planned = self.plan_bytes(self.cfg(name, best))
        ctx = f" (of which {CUDA_CONTEXT / GiB:.1f} GiB CUDA context outside torch's allocator)" if self.cuda else ""
        log(f"memory at b={best}: plan {planned / GiB:.3f} GiB{ctx}, measured max_memory_allocated "
            f"{r.peak_bytes / GiB:.3f} GiB" + ("" if self.cuda else " (no allocator statistics on the CPU)"))
        ratio("plan_vs_measured_mem_gpu", planned / r.peak_bytes)


def recipe_step(name: str, resources: str | None) -> tuple[int, int, int, bool]:
    """(micro batch, accumulation, ZeRO stage, activation checkpointing) of a recipe on its planned cluster:
    accumulation = global batch / (nodes x tasks per node x micro batch), with ``resources`` merged over it."""
    cfg = load_config(ROOT / "configs" / "pretrain" / f"{name}.yaml", [], resources=resources, world_size=1)
    t, c = cfg.train, cfg.cluster
    return t.micro_batch, max(1, t.global_batch // (c.nodes * c.tasks_per_node * t.micro_batch)), \
        cfg.engine.zero_stage, cfg.model.grad_checkpointing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="vit_l16,vit_b16",
                    help="recipes in configs/pretrain/, comma-separated; the first is compared with timm, the "
                         "plain loop, the loader and the plan (default vit_l16,vit_b16)")
    ap.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")], default=None,
                    help="micro batches to try, largest first (default: vit_l16 32,64,128,256; vit_b16 64,...,512)")
    ap.add_argument("--steps", type=int, default=None, help="steps per timed window (default 5; smoke 1)")
    ap.add_argument("--windows", type=int, default=None, help="timed windows, median taken (default 5; smoke 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; smoke 1)")
    ap.add_argument("--zero", type=int, default=2, choices=[1, 2], help="ZeRO stage (default 2)")
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                    help="train.compile for vitp: auto keeps the config's default (on for GPUs)")
    ap.add_argument("--classes", type=int, default=1000, help="head size (default 1000)")
    ap.add_argument("--loader-images", type=int, default=384, help="JPEGs written for the loader (default 384)")
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="soft time limit for the batch searches; later candidates are skipped (default 300)")
    ap.add_argument("--resources", default=str(ROOT / "configs" / "cluster" / "h100_8x.yaml"),
                    help="the cluster the recipe's accumulation is computed for (default configs/cluster/h100_8x.yaml)")
    ap.add_argument("--accum", type=int, default=None,
                    help="accumulation for the recipe section (default: the recipe's on --resources' cluster)")
    ap.add_argument("--sections", choices=["all", "search"], default="all",
                    help="search: only each model's micro-batch search and its mfu line (make gpu-check's "
                         "sized-down run); all: also the peers, loader, memory and recipe sections (default)")
    ap.add_argument("--smoke", action="store_true", help="every path on the CPU: tiny ViT, 1-2 steps, fp32, gloo")
    a = ap.parse_args(argv)
    smoke = a.smoke
    a.steps = a.steps or (1 if smoke else 5)
    a.windows = a.windows or (2 if smoke else 5)
    a.warmup = a.warmup if a.warmup is not None else (1 if smoke else 3)
    if smoke:
        a.budget_s = math.inf  # every path, however slow this CPU is today
    from pipeline.distributed import leave_process_group

    try:
        with contextlib.redirect_stdout(sys.stderr):  # libraries' prints must not mix with the ratio lines
            bench = Bench(a)
            try:
                bench.run()
            finally:
                bench.close()  # the loader's shards
    finally:
        leave_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
