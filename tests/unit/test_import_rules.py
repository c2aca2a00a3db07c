"""House rules on imports (README, "Architecture"): one owner per outside system; the model stays
pure torch; the layers import only downwards and never in a circle.

Parses every .py file of the repository with `ast` (imports inside functions included);
tests/ and bench/ are exempt, they may compare against anything.

pipeline.tracking (the sinks a run's records go to) imports neither .train nor .eval.

Layers, top to bottom:
    launch                                              starts things, parses argv
    pipeline.pretrain, pipeline.transfer, pipeline.evaluate       stages: fn(cfg) -> Result
    pipeline.weights, .train, .eval, .data, .plan, .tracking   the library
    pipeline.distributed, .config, .model, .files, .driver, .secrets, .rundir,
    .checkpoint_layout (which step-* folders count; train writes them, weights and eval read them),
    .world (rank and world size from any launcher's variables)
                                                        the ground floor
data_prep/ is offline and stands apart: no torch. A few modules are shared across that line, both ways:
    data_prep -> pipeline.files (atomic_write), pipeline.faults (the test-fault seam), pipeline.stops,
                 pipeline.errors (the error base): standard library only at import time, so data_prep
                 stays torch-free; pipeline.config.prep (prep's one
                 schema, which `vitp prep` and `vitp submit prep` parse into): pydantic, no torch
    pipeline  -> data_prep.schema (_info.json), data_prep.tar (tar reader), data_prep.images (decode
                 helpers): data_prep's torch-free library modules, never its commands
"""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXEMPT = ("tests", "bench")
SKIP_DIRS = {".venv", ".venv-floor", ".git", "build", "dist", "runs", "__pycache__", "node_modules"}

# module -> predicate on the repo-relative posix path of the importing file
OWNERS = {
    "deepspeed": lambda p: p == "pipeline/train/engine.py",
    "mlflow": lambda p: p in ("pipeline/tracking/mlflow_sink.py", "pipeline/tracking/mlflow_store.py"),
    "submitit": lambda p: p.startswith("launch/"),
    "webdataset": lambda p: p.startswith(("pipeline/data/", "data_prep/")),
    # dataset addresses (local, s3://, gs://, http(s)://): one module opens them all
    **{m: (lambda p: p == "data_prep/store.py") for m in ("fsspec", "s3fs", "gcsfs", "boto3", "botocore")},
}
MODEL_ALLOWED = {"torch", "einops", "pipeline"}
MODEL_LOADING = {"numpy", "safetensors"}  # reading checkpoint files only
MODEL_LOADING_FILES = {"pipeline/model/convert.py", "pipeline/model/load.py"}
STAGES = {"pipeline.pretrain", "pipeline.transfer", "pipeline.evaluate", "pipeline.preflight"}
LIBRARY = ("pipeline.weights", "pipeline.train", "pipeline.eval", "pipeline.data", "pipeline.plan",
           "pipeline.tracking")
GROUND = ("pipeline.distributed", "pipeline.network", "pipeline.config", "pipeline.model", "pipeline.files",
          "pipeline.driver", "pipeline.secrets", "pipeline.rundir", "pipeline.threads", "pipeline.stops",
          "pipeline.slurm", "pipeline.hang", "pipeline.error_record", "pipeline.errors", "pipeline.checkpoint_layout",
          "pipeline.world")
# faults is a library module (its pause gate reads the stop request, pipeline.stops) that data_prep may call
LIBRARY = (*LIBRARY, "pipeline.faults")
DATA_PREP_MAY_IMPORT = {"pipeline", "pipeline.files", "pipeline.faults", "pipeline.stops", "pipeline.errors",
                        "pipeline.config.prep"}
STDLIB_ONLY = {"pipeline/files.py": set(), "pipeline/faults.py": {"pipeline.files", "pipeline.stops", "pipeline.slurm"},
               "pipeline/stops.py": set(), "pipeline/errors.py": set(),
               "pipeline/slurm.py": {"pipeline.stops"}}  # + what they may import
# data_prep.store: every dataset address (folder, s3://, gs://, https://) is read through it
PIPELINE_MAY_IMPORT = {"data_prep.schema", "data_prep.tar", "data_prep.images", "data_prep.store"}


def layer(module: str) -> int | None:
    """3 launch, 2 stages, 1 library, 0 ground floor; None outside vitp's layers (e.g. data_prep)."""
    def under(prefixes):
        return any(module == p or module.startswith(p + ".") for p in prefixes)
    if under(("launch",)):
        return 3
    if module in STAGES:
        return 2
    if under(LIBRARY):
        return 1
    if under(GROUND) or module == "pipeline":
        return 0
    return None


def module_name(rel: str) -> str:
    mod = rel[:-3].replace("/", ".")
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


def imports(source: str, module: str) -> set[str]:
    """Full dotted names of every import in `source` (relative ones resolved against `module`);
    `from a import b` yields 'a.b' (b may be a module or a name in a)."""
    out = set()
    package = module.split(".")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[: len(package) - node.level + (1 if module.endswith("__init__") else 0)]
                base = ".".join([*parent, base] if base else parent)
            out.update(f"{base}.{alias.name}" for alias in node.names)
            out.add(base)
    return out


def imported_modules(source: str) -> set[str]:
    """Top-level names of every absolute import in `source` ('a.b.c' -> 'a')."""
    mods = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            mods.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods.add(node.module.split(".")[0])
    return mods


def violations(rel: str, mods: set[str]) -> list[str]:
    out = [f"{rel} imports {m} (only allowed in its owner)"
           for m, owner in OWNERS.items() if m in mods and not owner(rel)]
    if rel.startswith("pipeline/model/"):
        allowed = MODEL_ALLOWED | set(sys.stdlib_module_names)
        if rel in MODEL_LOADING_FILES:
            allowed |= MODEL_LOADING
        out += [f"{rel} imports {m} (pipeline/model may use torch/einops/stdlib only)"
                for m in sorted(mods - allowed)]
    if rel.startswith("data_prep/"):
        out += [f"{rel} imports {m} (data_prep stays free of torch and launch)"
                for m in sorted(mods & {"torch", "launch"})]
    return out


def shared_violations(rel: str, names: set[str], top_level: set[str]) -> list[str]:
    """The two-way line between data_prep and pipeline (see the module docstring). ``names``: every
    import's dotted name; ``top_level``: the dotted names imported at module level only."""
    out = []
    if rel.startswith("data_prep/"):
        out += [f"{rel} imports {n} (data_prep may use only {', '.join(sorted(DATA_PREP_MAY_IMPORT - {'pipeline'}))})"
                for n in sorted(names) if n.split(".")[0] == "pipeline"
                and n not in DATA_PREP_MAY_IMPORT
                and not n.startswith(("pipeline.files.", "pipeline.faults.", "pipeline.stops.", "pipeline.errors.",
                                      "pipeline.config.prep."))]
    if rel.startswith("pipeline/"):
        out += [f"{rel} imports {n} (pipeline may use only {', '.join(sorted(PIPELINE_MAY_IMPORT))} of data_prep)"
                for n in sorted(names) if n.split(".")[0] == "data_prep" and n != "data_prep"
                and not any(n == m or n.startswith(m + ".") for m in PIPELINE_MAY_IMPORT)]
    if rel in STDLIB_ONLY:
        ok = set(sys.stdlib_module_names) | {"__future__"}
        out += [f"{rel} imports {n} at module level (standard library only: data_prep imports it)"
                for n in sorted(top_level) if n.split(".")[0] not in ok and n != "pipeline"
                and not any(n == m or n.startswith(m + ".") for m in STDLIB_ONLY[rel])]
    return out


def top_level_imports(source: str) -> set[str]:
    """Dotted names imported by the module's own top-level statements (not inside functions)."""
    out = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def layer_violations(module: str, names: set[str], known: set[str]) -> list[str]:
    """Upward imports, and stage modules imported by anything but launch."""
    me = layer(module)
    out = []
    for name in sorted(names):
        target = _known_module(name, known)
        if target is None or target == module:
            continue
        there = layer(target)
        if me is not None and there is not None and there > me:
            out.append(f"{module} imports {target} (upward: layer {there} above {me})")
        if target in STAGES and (me is None or me != 3):
            out.append(f"{module} imports the stage {target} (only launch starts stages)")
    return out


def _known_module(name: str, known: set[str]) -> str | None:
    """The longest known module that `name` is, or is a name inside of."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in known:
            return ".".join(parts[:i])
    return None


def import_graph() -> dict[str, set[str]]:
    files = dict(_repo_files())
    known = {module_name(rel) for rel in files}
    graph = {}
    for rel, path in files.items():
        mod = module_name(rel)
        graph[mod] = {t for n in imports(path.read_text(encoding="utf-8"), mod)
                      if (t := _known_module(n, known)) is not None and t != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _repo_files():
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if SKIP_DIRS & set(rel.parts) or rel.parts[0] in EXEMPT:
            continue
        yield rel.as_posix(), path


def test_repository_follows_import_rules():
    found = []
    for rel, path in _repo_files():
        found += violations(rel, imported_modules(path.read_text(encoding="utf-8")))
    assert not found, "\n".join(found)


def test_data_prep_and_pipeline_share_only_torch_free_modules():
    found = []
    for rel, path in _repo_files():
        src = path.read_text(encoding="utf-8")
        found += shared_violations(rel, imports(src, module_name(rel)), top_level_imports(src))
    assert not found, "\n".join(found)
    # and at run time: data_prep's modules and the two it shares load no torch (nor numpy, for the shared ones)
    code = ("import sys, pipeline.files, pipeline.faults, data_prep.schema, data_prep.tar; "
            "heavy = sorted(m for m in ('torch', 'numpy') if m in sys.modules); "
            "import data_prep.build, data_prep.checks, data_prep.cli, data_prep.shards; "
            "print(heavy, 'torch' in sys.modules); sys.exit(1 if heavy or 'torch' in sys.modules else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_layers_import_only_downwards():
    files = dict(_repo_files())
    known = {module_name(rel) for rel in files}
    found = []
    for rel, path in files.items():
        mod = module_name(rel)
        found += layer_violations(mod, imports(path.read_text(encoding="utf-8"), mod), known)
    assert not found, "\n".join(found)


# Inside the library, top to bottom (imports inside functions count too): train runs everything; eval,
# weights and plan never import train; data, tracking and faults import none of those above them.
INNER = {"pipeline.train": 2, "pipeline.eval": 1, "pipeline.weights": 1, "pipeline.plan": 1,
         "pipeline.data": 0, "pipeline.tracking": 0, "pipeline.faults": 0}


def inner_layer(module: str) -> int | None:
    return next((v for k, v in INNER.items() if module == k or module.startswith(k + ".")), None)


def inner_violations(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) pairs inside the library that point upward; a ground-floor module that
    imports the library, a stage or launch is one too."""
    out = set()
    for mod, targets in graph.items():
        for t in targets:
            me, there = inner_layer(mod), inner_layer(t)
            if me is not None and there is not None and there > me:
                out.add((mod, t))
            if layer(mod) == 0 and mod != "pipeline" and (layer(t) or 0) > 0:
                out.add((mod, t))
    return out


def test_library_layers_import_only_downwards():
    found = inner_violations(import_graph())
    assert not found, "arrows up inside pipeline/: " + "; ".join(f"{a} -> {b}" for a, b in sorted(found))


def test_a_planted_arrow_up_fails_the_library_layers():
    graph = import_graph()
    assert ("pipeline.eval.task", "pipeline.train.loss") not in inner_violations(graph)
    planted = {**graph, "pipeline.eval.task": {*graph["pipeline.eval.task"], "pipeline.train.loss"},
               "pipeline.config.stages": {*graph["pipeline.config.stages"], "pipeline.data"}}
    assert inner_violations(planted) - inner_violations(graph) == {("pipeline.eval.task", "pipeline.train.loss"),
                                                                   ("pipeline.config.stages", "pipeline.data")}
    lazy = "def f():\n    from pipeline.train import loss\n"  # an import inside a function is an arrow too
    assert "pipeline.train.loss" in imports(lazy, "pipeline.eval.task")


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_tracking_stands_apart_from_train_and_eval():
    """The sinks serve the training loop and the evaluation stage alike: they import neither."""
    files = dict(_repo_files())
    known = {module_name(rel) for rel in files}
    found = [f"{rel} imports {t}" for rel, path in files.items() if rel.startswith("pipeline/tracking/")
             for n in imports(path.read_text(encoding="utf-8"), module_name(rel))
             if (t := _known_module(n, known)) and t.startswith(("pipeline.train", "pipeline.eval"))]
    assert "pipeline/tracking/sink.py" in files and not found, "\n".join(found)


def test_stage_imports_without_launch():
    code = ("import sys, pipeline.pretrain, pipeline.transfer, pipeline.evaluate, pipeline.preflight; "
            "bad = sorted(m for m in sys.modules if m == 'launch' or m.startswith('launch.') "
            "or m == 'deepspeed' or m.startswith('deepspeed.')); print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_model_package_is_scanned():
    rels = {rel for rel, _ in _repo_files()}
    assert {"pipeline/model/vit.py", "pipeline/train/loop.py", "launch/stages.py"} <= rels


def test_checker_catches_violations():
    src = "import os\nfrom timm.layers import Mlp\ndef f():\n    import deepspeed\n"
    mods = imported_modules(src)
    assert mods == {"os", "timm", "deepspeed"}
    v = violations("pipeline/model/vit.py", mods)
    assert any("deepspeed" in x for x in v) and any("timm" in x for x in v)
    assert not any("os" in x.split(" imports ")[1] for x in v)
    assert violations("pipeline/train/engine.py", {"deepspeed"}) == []
    assert violations("launch/submit.py", {"submitit"}) == []
    assert violations("pipeline/train/loop.py", {"submitit"}) != []
    assert violations("data_prep/shard.py", {"webdataset"}) == []
    assert violations("data_prep/shard.py", {"torch"}) != []
    assert violations("pipeline/model/vit.py", {"numpy"}) != []
    assert violations("pipeline/model/convert.py", {"numpy", "safetensors"}) == []
    known = {"launch.cli", "pipeline.pretrain", "pipeline.train.loop", "pipeline.config", "pipeline.weights"}
    assert layer_violations("pipeline.train.loop", {"launch.cli.parser_for"}, known)  # upward
    assert layer_violations("pipeline.weights", {"pipeline.pretrain.pretrain"}, known)  # a stage, not from launch
    assert layer_violations("launch.cli", {"pipeline.pretrain"}, known) == []
    assert layer_violations("pipeline.train.loop", {"pipeline.config.Config", "torch"}, known) == []
    assert imports("from .augment import x", "pipeline.data.loader") >= {"pipeline.data.augment.x"}
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert violations("data_prep/shards.py", {"pipeline"}) == []  # which pipeline modules: shared_violations
    assert shared_violations("data_prep/x.py", {"pipeline.files.atomic_write", "pipeline"}, set()) == []
    assert shared_violations("data_prep/x.py", {"pipeline.data.loader"}, set())
    assert shared_violations("pipeline/data/shards.py", {"data_prep.tar.iter_tar"}, set()) == []
    assert shared_violations("pipeline/data/shards.py", {"data_prep.build.prep"}, set())
    assert shared_violations("pipeline/faults.py", set(), {"os", "pipeline.files.atomic_write"}) == []
    assert shared_violations("pipeline/faults.py", set(), {"torch"})
    known = {"pipeline.faults", "pipeline.stops"}
    assert layer_violations("pipeline.faults", {"pipeline.stops"}, known) == []


# ── Private names stay private ─────────────────────────────────────────────────────────────────────
PRIVATE_RULE_DIRS = ("pipeline", "launch", "data_prep", "bench", "tests")


def private_imports(source: str, rel: str) -> list[str]:
    """``file:line`` lines for every ``from X import _name`` (absolute or relative; a leading underscore,
    not a dunder): a name its module keeps to itself is not another module's to use. A module that
    needs it should get a public name for it instead."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        for alias in node.names:
            name = alias.name
            if name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
                out.append(f"{rel}:{node.lineno}: from {'.' * node.level}{node.module or ''} import {name}")
    return out


def test_no_module_imports_another_modules_private_name():
    found = []
    for top in PRIVATE_RULE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if not SKIP_DIRS & set(rel.parts):
                found += private_imports(path.read_text(encoding="utf-8"), rel.as_posix())
    assert not found, "imports of private names:\n" + "\n".join(found)


def test_private_import_checker_names_file_and_line():
    src = ("import os\nfrom pipeline.data.loader import TrainLoader, _as_is\n"
           "def f():\n    from .shards import _Counts as C, __version__\n    from . import _secret\n")
    assert private_imports(src, "bench/x.py") == ["bench/x.py:2: from pipeline.data.loader import _as_is",
                                                  "bench/x.py:4: from .shards import _Counts",
                                                  "bench/x.py:5: from . import _secret"]
    assert private_imports("from a import b, __all__\nimport _thread\n", "t.py") == []
