"""Walk a run's ``cfg`` through the code: how often the training stage hands its config from part to part.

Runs a tiny 1-rank pre-training in this process (synthetic data, a validation pass, two checkpoints,
MLflow to a local SQLite store) under ``sys.setprofile`` and follows every function of pipeline/ that
is *given* the config or one of its sections as an argument. The room the walk is in is the module
(file) of the innermost such call; a call into another module walks there, its return walks back.
A call site is walked the first time it runs (the next step's calls are the same code, read once).

    rooms    modules the walk visits
    stays    consecutive visits to one room (the walk's length)
    climbs   moves back up: returns into a room that imports the one just left (directly or not), the
             walk returning to a caller that fetched something from a part below it (a call that
             walks into an importer, e.g. a base class's method calling its subclass's module, is
             no return and no climb; ``--trace`` lists each climb with the call that returned)
    returns  moves into a room the walk had already left

A part that owns its config (given once, when it is built) and its state keeps the walk short; a
loop that passes ``cfg`` to part after part and hands each part's state back by hand makes it long.

    python -m tests.cfg_walk [--trace] [--json FILE]     prints `cfg walk: R rooms, S stays, C climbs, T returns`
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "pipeline"


@functools.cache
def module_of(filename: str) -> str | None:
    """'pipeline/train/loop.py' -> 'pipeline.train.loop'; None outside pipeline/."""
    p = Path(filename).resolve()
    if PIPELINE not in p.parents:
        return None
    mod = ".".join(p.relative_to(ROOT).with_suffix("").parts)
    return mod.removesuffix(".__init__")


def _sections(cfg) -> set[int]:
    """ids of the config and of every section object inside it (dataclass or pydantic model)."""
    seen, todo = set(), [cfg]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if dataclasses.is_dataclass(obj):
            values = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
        elif hasattr(type(obj), "model_fields"):
            values = [getattr(obj, name) for name in type(obj).model_fields]
        else:
            continue
        todo += [v for v in values if dataclasses.is_dataclass(v) or hasattr(type(v), "model_fields")]
    return seen


def trace(run, moves: list | None = None) -> list[str]:
    """The rooms, in order, of the calls that are given ``cfg`` (or a section) while ``run(cfg)`` runs.
    ``run`` -> (cfg, fn): the trace starts when ``fn(cfg)`` is called. ``moves``, if given, gets one
    entry per room: None where a call walked in, else (function, what it returned) where a return did."""
    cfg, fn = run()
    ids, stack, rooms, walked = _sections(cfg), [], [], set()
    moves = [] if moves is None else moves

    def given_cfg(frame) -> bool:
        code = frame.f_code
        n = code.co_argcount + code.co_kwonlyargcount
        loc = frame.f_locals
        return any(id(loc.get(name)) in ids for name in code.co_varnames[:n])

    def note(via=None) -> None:
        room = stack[-1][1] if stack else None
        if room is not None and (not rooms or rooms[-1] != room):
            rooms.append(room)
            moves.append(via)

    def prof(frame, event, arg):
        if event == "call":
            mod = module_of(frame.f_code.co_filename)
            if mod is not None and given_cfg(frame):
                # a call site walked once already (a loop's next step) is read once, as in the code
                site = (frame.f_back.f_code, frame.f_back.f_lineno, frame.f_code)
                silent = (stack and stack[-1][2]) or site in walked
                walked.add(site)
                stack.append((frame, mod, silent))
                if not silent:
                    note()
        elif event == "return" and stack and stack[-1][0] is frame:
            if not stack.pop()[2]:
                code = frame.f_code
                built = frame.f_locals.get("self") if code.co_name == "__init__" else arg
                note((code.co_qualname, type(built).__qualname__))

    sys.setprofile(prof)
    try:
        fn(cfg)
    finally:
        sys.setprofile(None)
    return rooms


def import_graph() -> dict[str, set[str]]:
    """module -> the pipeline modules it imports (any import statement, inside functions too)."""
    graph = {}
    for f in PIPELINE.rglob("*.py"):
        mod = module_of(str(f))
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".")[: len(mod.split(".")) - node.level + (f.name == "__init__.py")]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            deps |= {n for n in names if n.startswith("pipeline")}
        graph[mod] = deps
    return graph


def above(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """module -> every module that imports it, directly or not (the rooms above it)."""
    closure = {}

    def reach(m: str, seen: set[str]) -> set[str]:
        for d in graph.get(m, ()):
            if d not in seen and d != m:
                seen.add(d)
                reach(d, seen)
        return seen

    below = {m: reach(m, set()) for m in graph}
    for m in graph:
        closure[m] = {u for u, b in below.items() if m in b}
    return closure


def score(rooms: list[str], moves: list | None = None) -> dict:
    """``moves`` (from :func:`trace`): which moves were returns; without it every move may climb."""
    ups = above(import_graph())
    moves = moves or [()] * len(rooms)
    climbs = sum(b in ups.get(a, set()) and via is not None for a, b, via in zip(rooms, rooms[1:], moves[1:]))
    returns = sum(r in rooms[:i - 1] for i, r in enumerate(rooms) if i > 0)
    return {"rooms": len(set(rooms)), "stays": len(rooms), "climbs": climbs, "returns": returns}


def tiny_pretrain(run_dir: str):
    """A 1-rank tiny pre-training: 4 steps, validation and a checkpoint every 2, MLflow to SQLite."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    from pipeline.config import load_config
    from pipeline.pretrain import pretrain

    cfg = load_config(ROOT / "configs/pretrain/tiny_cpu.yaml", [
        f"run.dir={run_dir}", "data.path=synthetic:classes=4,train=128,val=32", "data.workers=0",
        "train.steps=4", "train.log_every=2", "train.eval_every=2", "checkpoint.every=2",
        f"tracking.uri=sqlite:///{run_dir}/mlflow.db", "train.global_batch=16", "train.micro_batch=16",
        "engine.zero_stage=1"], world_size=1)
    return cfg, pretrain


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.cfg_walk", description=__doc__.split("\n")[0])
    p.add_argument("--trace", action="store_true", help="print the rooms in order")
    p.add_argument("--json", metavar="FILE", help="also write the rooms and moves to FILE")
    args = p.parse_args(argv)
    moves: list = []
    with tempfile.TemporaryDirectory() as d:
        rooms = trace(lambda: tiny_pretrain(str(Path(d) / "run")), moves)
    if args.json:
        Path(args.json).write_text(json.dumps({"rooms": rooms, "moves": moves}))
    if args.trace:
        print(" -> ".join(r.removeprefix("pipeline.") for r in rooms))
        ups = above(import_graph())
        for a, b, via in zip(rooms, rooms[1:], moves[1:]):
            if via is not None and b in ups.get(a, set()):  # a climb: which call returned, and what
                print(f"climb {a.removeprefix('pipeline.')} -> {b.removeprefix('pipeline.')}: "
                      f"{via[0]} returned {via[1]}")
    s = score(rooms, moves)
    print(f"cfg walk: {s['rooms']} rooms, {s['stays']} stays, {s['climbs']} climbs, {s['returns']} returns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
