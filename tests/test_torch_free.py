"""The scheduler, the simulator, the load generator and the text layer never import torch or
tollway.model: `tollway simulate` and `tollway bench` run on a machine without torch, and the
scheduler stays a plain-Python description of a step. Checked in a fresh interpreter: modules
are imported where importing either raises, and the commands are run and then asked whether
either was loaded (transformers, which converts a GGUF's tokenizer, probes for torch)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

BLOCKER = textwrap.dedent("""
    import importlib.abc, sys

    class Blocked(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] == "torch" or name == "tollway.model" or name.startswith("tollway.model."):
                raise ImportError(f"{name} is blocked here")

    sys.meta_path.insert(0, Blocked())
""")


def _run(body: str, *args: str, block: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", (BLOCKER if block else "") + textwrap.dedent(body), *args],
                          capture_output=True, text=True, timeout=300)


def test_the_blocker_blocks():
    done = _run("import torch")
    assert done.returncode != 0 and "torch is blocked here" in done.stderr


def test_scheduler_sim_bench_and_text_import_without_torch():
    done = _run("""
        import importlib, pkgutil
        import tollway.bench, tollway.scheduler, tollway.sim, tollway.text, tollway.traffic
        names = ["tollway.checkpoint", "tollway.model_config", "tollway.cli"]
        for package in (tollway.bench, tollway.scheduler, tollway.sim, tollway.text, tollway.traffic):
            names += [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
        for name in names:
            importlib.import_module(name)
        print(len(names))
    """)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) >= 30


def test_simulate_on_a_hardware_estimate_and_a_gguf_tokenizer_run_without_torch(tmp_path, tiny_gguf):
    """The two paths that used to load torch: the model's shapes for --hardware, and the tokenizer
    bench measures prompts with (read from a GGUF alone, into an empty cache; the tiny one, as the
    default's 262k-token vocabulary takes the gguf reader half a minute on the same path)."""
    done = _run("""
        import json, sys
        from tollway.checkpoint import tokenizer_path
        from tollway.cli import main
        from tollway.text.tokenizer import Tokenizer

        out, cache, gguf = sys.argv[1], sys.argv[2], sys.argv[3]
        code = main(["simulate", "--hardware", "H200", "--rate", "20", "--max-requests", "30",
                     "--output-tokens", "8", "--output", out, "--quiet"])
        folder = tokenizer_path(gguf, cache)
        ids = Tokenizer.load(folder).encode("Hello there")
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "torch" or m.startswith("tollway.model."))
        print(json.dumps({"code": code, "folder": str(folder), "ids": len(ids), "loaded": loaded}))
    """, str(tmp_path / "sim"), str(tmp_path / "cache"), str(tiny_gguf), block=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["code"] == 0 and result["ids"] >= 2 and result["loaded"] == []
    assert (tmp_path / "sim" / "bench.json").is_file()
    # only the tokenizer was written: no converted weights
    assert result["folder"].startswith(str(tmp_path / "cache"))
    assert not list((tmp_path / "cache").rglob("*.safetensors"))


# Which packages a layer must never import, at module level or inside a function: the scheduler
# is a plain description of a step; the simulator and the bench share `traffic` and know
# nothing of each other, of the model or of the server; the model knows nothing of what runs it.
LAYER_RULES = {
    "tollway.traffic": ("torch", "tollway.model", "tollway.engine", "tollway.async_engine", "tollway.scheduler",
                        "tollway.sim", "tollway.bench", "tollway.server", "tollway.fleet", "tollway.cli"),
    "tollway.scheduler": ("torch", "tollway.model", "tollway.engine", "tollway.async_engine", "tollway.sim",
                          "tollway.bench", "tollway.traffic", "tollway.server", "tollway.fleet", "tollway.cli"),
    "tollway.sim": ("torch", "tollway.model", "tollway.engine", "tollway.async_engine", "tollway.bench",
                    "tollway.server", "tollway.fleet", "tollway.cli"),
    "tollway.bench": ("torch", "tollway.model", "tollway.engine", "tollway.async_engine", "tollway.sim",
                      "tollway.server", "tollway.fleet", "tollway.cli"),
    "tollway.text": ("torch", "tollway.model", "tollway.engine", "tollway.server", "tollway.cli"),
    "tollway.model": ("tollway.engine", "tollway.async_engine", "tollway.sim", "tollway.bench", "tollway.traffic",
                      "tollway.server", "tollway.fleet", "tollway.cli"),
    "tollway.server": ("tollway.sim", "tollway.bench", "tollway.cli"),
    "tollway.meter": ("tollway.model", "tollway.engine", "tollway.sim", "tollway.bench", "tollway.server",
                      "tollway.cli"),
}


def _imports(path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every import in the file, wherever it sits."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module, [alias.name for alias in node.names]))
    return found


def _layer_breaches(root) -> list[str]:
    breaches = []
    for path in sorted(root.rglob("*.py")):
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        layer, forbidden = next(((layer, banned) for layer, banned in LAYER_RULES.items()
                                 if module == layer or module.startswith(layer + ".")), (module, ()))
        for line, imported, names in _imports(path):
            hit = next((b for b in forbidden if imported == b or imported.startswith(b + ".")), None)
            if hit:
                breaches.append(f"{path.name}:{line} imports {imported} ({layer} must not import {hit})")
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if imported.startswith("tollway.") and private:
                breaches.append(f"{path.name}:{line} imports {', '.join(private)} from {imported}: private there")
    return breaches


def test_each_layer_imports_only_what_it_may():
    from pathlib import Path

    import tollway

    assert _layer_breaches(Path(tollway.__file__).parent) == []


def test_the_layer_check_finds_imports_inside_functions_and_private_names(tmp_path):
    package = tmp_path / "tollway"
    (package / "scheduler").mkdir(parents=True)
    (package / "scheduler" / "late.py").write_text("def f():\n    from tollway.model.runner import ModelRunner\n")
    (package / "sim").mkdir()
    (package / "sim" / "peek.py").write_text("from tollway.traffic.plots import _finished\n")
    (package / "cli.py").write_text("from tollway.sim import cli\n")  # the top-level CLI may import any layer
    assert _layer_breaches(package) == [
        "late.py:2 imports tollway.model.runner (tollway.scheduler must not import tollway.model)",
        "peek.py:1 imports _finished from tollway.traffic.plots: private there"]


def _private_reach(path) -> list[str]:
    """Each `x._name` in the file where x is not self, cls or super(): another object's private
    state (namedtuple's public _replace aside)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                and node.attr != "_replace":
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue
            found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_policies_the_simulator_and_the_server_reach_no_private_state():
    """Policies ask the scheduler through its view (scheduler_view.py); the simulator and the
    server use the engine's and the scheduler's public surface."""
    from pathlib import Path

    import tollway

    root = Path(tollway.__file__).parent
    files = [root / "scheduler" / "policies.py", *sorted((root / "sim").glob("*.py")),
             *sorted((root / "server").glob("*.py"))]
    assert [hit for path in files for hit in _private_reach(path)] == []


def test_the_private_reach_check_finds_it(tmp_path):
    path = tmp_path / "policy.py"
    path.write_text("def f(s):\n    return s._entries, self._mine, super()._hook(), row._replace(a=1)\n")
    assert _private_reach(path) == ["policy.py:2 s._entries"]
