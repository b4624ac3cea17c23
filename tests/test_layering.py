"""Package layering, read from the source with `ast` (nothing imported, no torch needed).

Layers, lowest first: the flat core (with dspine.kernels and dspine.workloads) ← eval ← train ← serve | sglang
← agents ← adapt ← cli. A module imports its own subpackage, the core and lower layers only; serve and sglang,
side by side, do not import each other. Heavy optional dependencies stay inside their own subpackage.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {
    "dspine": "dspine",
    "kernels": "dspine.kernels",
    "workloads": "dspine.workloads",
    "agents": "dspine.agents",
    "adapt": "dspine.adapt",
    "drafters": "dspine.drafters",
}
RANK = {"core": 0, "eval": 1, "train": 2, "serve": 3, "sglang": 3, "agents": 4, "adapt": 5, "cli": 6}
SUBPACKAGES = {"eval", "train", "serve", "sglang", "agents", "adapt"}
OWNER = {
    "fastapi": "serve",
    "uvicorn": "serve",
    "litellm": ("serve", "agents"),
    "prometheus_client": "serve",
    "sglang": "sglang",
    "ray": "adapt",
    "peft": "adapt",
    "triton": "core",
    "minisweagent": "agents",
    "docx": "agents",
    "openpyxl": "agents",
}


def layer(module: str) -> str:
    """dspine.serve.server -> serve; dspine.cli -> cli; dspine.engine, dspine.kernels.x -> core."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in SUBPACKAGES:
        return parts[1]
    return "cli" if parts[1:2] == ["cli"] else "core"


def modules(root: Path):
    """(module name, path, is package __init__) of every source file of the installed packages."""
    for folder, package in FOLDERS.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("").parts
            init = rel[-1] == "__init__"
            parts = rel[:-1] if init else rel
            yield ".".join((package, *parts)), path, init


def imports(module: str, path: Path, init: bool):
    """(imported module, line) for every import statement, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if init else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            if base == "dspine" or (node.level and not node.module):  # from dspine import kernels / from . import x
                yield from ((f"{base}.{a.name}", node.lineno) for a in node.names)
            else:
                yield base, node.lineno


def violations(root: Path) -> list[str]:
    out = []
    for module, path, init in modules(root):
        mine = layer(module)
        for name, line in imports(module, path, init):
            where = f"{path.relative_to(root)}:{line}: {module} imports {name}"
            top = name.split(".")[0]
            owners = OWNER.get(top, ())
            owners = (owners,) if isinstance(owners, str) else owners
            if owners and mine not in owners and not ("core" in owners and module.startswith("dspine.kernels")):
                out.append(f"{where} ({top} belongs to {OWNER[top]})")
            if top == "triton" and not module.startswith("dspine.kernels"):
                out.append(f"{where} (triton is imported by dspine.kernels only)")
            if top in ("kernels", "workloads", "agents", "adapt", "drafters"):
                out.append(f"{where} (a top-level name; use dspine.{top})")
            if top != "dspine" or name == "dspine":
                continue
            theirs = layer(name)
            if theirs != mine and (RANK[theirs] > RANK[mine] or RANK[theirs] == RANK[mine]):
                out.append(f"{where} ({mine} may not import {theirs})")
    return out


def test_the_project_keeps_its_layers():
    assert violations(ROOT) == []


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    "files,needle",
    [
        ({"dspine/engine.py": "from dspine.serve.server import Service\n"}, "core may not import serve"),
        ({"dspine/train/loop.py": "from ..serve import store\n"}, "train may not import serve"),
        ({"dspine/eval/acceptance.py": "import dspine.train.loop\n"}, "eval may not import train"),
        ({"dspine/sglang/bench.py": "from dspine.serve.server import free_port\n"}, "sglang may not import serve"),
        ({"dspine/drafter.py": "def f():\n    import fastapi\n"}, "fastapi belongs to serve"),
        ({"dspine/train/run.py": "import ray\n"}, "ray belongs to adapt"),
        ({"dspine/engine.py": "import triton\n"}, "dspine.kernels only"),
        ({"dspine/decoding.py": "from kernels.transition import walk\n"}, "use dspine.kernels"),
        ({"kernels/injection.py": "from dspine.serve import metrics\n"}, "core may not import serve"),
    ],
)
def test_a_wrong_import_in_a_fixture_tree_is_caught(tmp_path, files, needle):
    root = _tree(tmp_path, {"dspine/__init__.py": "", "dspine/cli.py": "from dspine.serve import server\n", **files})
    found = violations(root)
    assert any(needle in v for v in found), found
    assert not any("dspine/cli.py" in v for v in found)  # the top layer may import everything


def test_a_clean_fixture_tree_passes(tmp_path):
    root = _tree(
        tmp_path,
        {
            "dspine/__init__.py": "",
            "dspine/engine.py": "from dspine import kernels\nfrom dspine.stats import AcceptanceStats\n",
            "dspine/serve/server.py": "import fastapi\nfrom dspine.eval import acceptance\nfrom . import protocol\n",
            "kernels/injection.py": "import triton\nfrom .candidates import x\n",
        },
    )
    assert violations(root) == []


def test_dspine_is_the_only_top_level_name(tmp_path):
    """kernels/, workloads/, agents/ and adapt/ install as dspine subpackages: outside the checkout, a bare
    `import kernels` is not ours (Hugging Face's `kernels` package, which transformers imports, stays free)."""
    import subprocess
    import sys

    code = (
        "import importlib.util, json, dspine.kernels, dspine.workloads, dspine.agents, dspine.adapt, dspine.drafters\n"
        "spec = {n: importlib.util.find_spec(n) for n in ('kernels', 'workloads', 'agents', 'adapt', 'drafters')}\n"
        "print(json.dumps({n: s.origin if s else None for n, s in spec.items()}))\n"
        "print(dspine.kernels.__file__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    found, kernels_file = out.stdout.splitlines()
    for name, origin in __import__("json").loads(found).items():
        assert origin is None or not origin.startswith(str(ROOT)), (name, origin)
    assert Path(kernels_file).parent == ROOT / "kernels"
