"""House rules on imports (DESIGN.md): one owner per outside system; the model stays pure torch.

Parses every .py file of the repository with `ast` (imports inside functions included);
tests/ and bench/ are exempt, they may compare against anything.
"""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXEMPT = ("tests", "bench")
SKIP_DIRS = {".venv", ".git", "build", "dist", "runs", "__pycache__", "node_modules"}

# module -> predicate on the repo-relative posix path of the importing file
OWNERS = {
    "deepspeed": lambda p: p == "pipeline/train/engine.py",
    "mlflow": lambda p: p == "pipeline/train/tracking.py",
    "submitit": lambda p: p.startswith("launch/"),
    "webdataset": lambda p: p in ("pipeline/data/loader.py", "pipeline/data/shards.py") or p.startswith("data_prep/"),
}
MODEL_ALLOWED = {"torch", "einops", "pipeline"}
MODEL_LOADING = {"numpy", "safetensors"}  # reading checkpoint files only
MODEL_LOADING_FILES = {"pipeline/model/convert.py", "pipeline/model/load.py"}


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


def test_model_package_is_scanned():
    assert "pipeline/model/vit.py" in {rel for rel, _ in _repo_files()}


def test_checker_catches_violations():
    src = "import os\nfrom timm.layers import Mlp\ndef f():\n    import deepspeed\n"
    mods = imported_modules(src)
    assert mods == {"os", "timm", "deepspeed"}
    v = violations("pipeline/model/vit.py", mods)
    assert any("deepspeed" in x for x in v) and any("timm" in x for x in v)
    assert not any("os" in x.split(" imports ")[1] for x in v)
    assert violations("pipeline/train/engine.py", {"deepspeed"}) == []
    assert violations("launch/submit.py", {"submitit"}) == []
    assert violations("pipeline/train.py", {"submitit"}) != []
    assert violations("data_prep/shard.py", {"webdataset"}) == []
    assert violations("pipeline/model/vit.py", {"numpy"}) != []
    assert violations("pipeline/model/convert.py", {"numpy", "safetensors"}) == []
