"""The architecture's rules, checked on the source (docs/architecture.md states them).

Fast and pure Python: the source is read with ``ast``. The checks that must import tfdp run in
fresh subprocesses, so what they import is theirs alone (this test process has TensorFlow
already: tests/conftest.py configures CPU replicas).

* no import circle among tfdp's modules (explicit import statements, at any depth);
* nothing imports upward between packages, except the edges listed in ``KNOWN_UPWARD``;
* no module over ``MAX_MODULE_LINES`` lines, no function over ``MAX_FUNCTION_LINES``;
* every public name of /work/shared/DESIGN.md's contract is importable, ``python -m tfdp.run
  --help`` works, and setup.cfg's console script resolves;
* docs/architecture.md names every module;
* the pure-Python parts import neither TensorFlow nor Keras.
"""

from __future__ import annotations

import ast
import configparser
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = REPO / "tfdp"
DOC = REPO / "docs" / "architecture.md"

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80

# Bottom to top. A module may import its own package's modules and any lower layer's;
# ``launcher`` is pure Python beside the stack and imports only the two bottom layers. The
# top-level shims (``tfdp/__init__.py``, ``run.py``, ``schedules.py``) may import anything.
LAYERS = ["process_state", "protocol", "said_once", "cluster", "_tf_private", "strategy",
          "optimizers", "data", "resilience", "callbacks", "horovod",
          "keras_distribution"]
LAUNCHER_MAY_IMPORT = {"protocol", "cluster", "launcher"}
SHIMS = {"tfdp", "tfdp.run", "tfdp.schedules", "tfdp.chief_writes"}
# Upward edges that exist today (function-level imports, so no circle at import time). A new
# one fails test_nothing_imports_upward: move the code down, or list it here with the reason.
KNOWN_UPWARD: set = set()  # none: Agreement and the step timing are the strategy's

PURE_PYTHON = ["tfdp.cluster", "tfdp.protocol", "tfdp.said_once", "tfdp.process_state",
               "tfdp.launcher.arguments", "tfdp.launcher.cli", "tfdp.launcher.policy",
               "tfdp.launcher.processes", "tfdp.launcher.hosts", "tfdp.launcher.remote",
               "tfdp.resilience", "tfdp.strategy.options", "tfdp.strategy.lifecycle",
               "tfdp.strategy.deadline", "tfdp.strategy.agreement", "tfdp.strategy.timing",
               "tfdp.strategy.buckets", "tfdp.run", "tfdp.keras_distribution",
               "tfdp.keras_distribution.plan"]


def _env():
    env = dict(os.environ)
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _run(code: str, *args, timeout=240):
    return subprocess.run([sys.executable, *args] if not code else
                          [sys.executable, "-c", textwrap.dedent(code)],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)


# --- the import graph -------------------------------------------------------------------------

def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def tfdp_modules() -> dict:
    """Module name -> path, for every module of tfdp/ (a package is its ``__init__``)."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: pathlib.Path, modules) -> set:
    """The tfdp modules ``name`` imports explicitly, at module level or in any function.

    ``import a.b`` and ``from a.b import c`` are edges to ``a.b``, or to ``a.b.c`` when that is
    a module; relative imports are resolved; the parent packages Python runs on the way are not
    counted (the rule is about what a module names).
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            edges.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    edges.add(f"{base}.{alias.name}")
                elif base in modules:
                    edges.add(base)
    edges.discard(name)
    return edges


def import_graph() -> dict:
    modules = tfdp_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict):
    """One import circle of ``graph`` (``[a, b, ..., a]``), or None. Iterative DFS."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = {node: WHITE for node in graph}
    for start in sorted(graph):
        if colour[start] != WHITE:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        colour[start] = GREY
        while stack:
            node, children = stack[-1]
            for child in children:
                if colour.get(child, BLACK) == GREY:
                    return path[path.index(child):] + [child]
                if colour.get(child) == WHITE:
                    colour[child] = GREY
                    path.append(child)
                    stack.append((child, iter(sorted(graph[child]))))
                    break
            else:
                colour[node] = BLACK
                path.pop()
                stack.pop()
    return None


def test_guard_find_cycle_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"a", "b", "c"}
    assert find_cycle({"a": {"a"}}) == ["a", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_guard_import_graph_reads_the_edges():
    graph = import_graph()
    # module level, function level, `from package import submodule`, a package's __init__
    assert "tfdp.strategy.gradient_hooks" in graph["tfdp.strategy.keras_integration"]
    assert "tfdp.strategy.agreement" in graph["tfdp.strategy.consensus"]  # inside a function
    assert "tfdp._tf_private" in graph["tfdp.strategy.deadline"]  # inside a function
    assert "tfdp.strategy.timing" in graph["tfdp.resilience.stragglers"]
    assert "tfdp.launcher.cli" in graph["tfdp.run"]
    # a parent package is not implied
    assert "tfdp.launcher" not in graph["tfdp.launcher.cli"]


def test_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def _layer(module: str):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_nothing_imports_upward():
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = set()
    for module, targets in import_graph().items():
        if module in SHIMS:
            continue
        source = _layer(module)
        for target in targets:
            to = _layer(target)
            if to is None or to == source:
                continue
            if source == "launcher" or to == "launcher":
                ok = source == "launcher" and to in LAUNCHER_MAY_IMPORT
            else:
                ok = rank[to] < rank[source]
            if not ok:
                upward.add((module, target))
    new = sorted(upward - KNOWN_UPWARD)
    assert not new, f"imports upward (see LAYERS): {new}"
    gone = sorted(KNOWN_UPWARD - upward)
    assert not gone, f"KNOWN_UPWARD lists edges that no longer exist, remove them: {gone}"


# --- sizes ------------------------------------------------------------------------------------

def test_no_module_or_function_too_long():
    offenders = []
    for name, path in tfdp_modules().items():
        source = path.read_text()
        lines = len(source.splitlines())
        if lines > MAX_MODULE_LINES:
            offenders.append(f"{path.relative_to(REPO)}: {lines} lines (> {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(source, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: "
                                     f"{length} lines (> {MAX_FUNCTION_LINES})")
    assert not offenders, "\n".join(offenders)


# --- the public contract ----------------------------------------------------------------------

PUBLIC_NAMES = r"""
import json, sys
import tfdp, tfdp.optimizers, tfdp.schedules, tfdp.data, tfdp.callbacks, tfdp.resilience
import tfdp.cluster
missing = []
def need(owner, label, names):
    for n in names:
        if not hasattr(owner, n):
            missing.append(f"{label}.{n}")
need(tfdp, "tfdp", ["configure_cpu_replicas", "DataParallelStrategy", "ShardedOptimizer",
                    "ClusterConfig", "ClusterConfigError", "scale_learning_rate",
                    "compile_gradients", *tfdp.__all__])
need(tfdp.optimizers, "tfdp.optimizers", ["LARS", "LAMB", "ShardedOptimizer",
                                          *tfdp.optimizers.__all__])
need(tfdp.schedules, "tfdp.schedules", ["WarmupCosineDecay", "WarmupPolynomialDecay",
                                        "scale_learning_rate", "steps_for_epochs",
                                        *tfdp.schedules.__all__])
need(tfdp.data, "tfdp.data", ["distribute", "Files", "Service", "DataShardingError",
                              *tfdp.data.__all__])
need(tfdp.callbacks, "tfdp.callbacks", ["BackupAndRestore", "DatasetEpoch", "StragglerMonitor",
                                        "is_chief", "write_path", *tfdp.callbacks.__all__])
need(tfdp.resilience, "tfdp.resilience", tfdp.resilience.__all__)
need(tfdp.cluster, "tfdp.cluster", ["ATTEMPT_ENV", "CONTROL_DIR_ENV", "CPU_REPLICAS_ENV",
                                    "EVICT_FILE", "EXIT_PREEMPTED", "EXIT_RESTART_REQUESTED",
                                    "GRACE_ENV", "MIN_WORKERS_ENV", "PORT_BASE_ENV", "RANK_ENV",
                                    "READY_FILE_ENV", "RESTARTS_LEFT_ENV", "SLOT_ENV",
                                    "progress_file", *tfdp.cluster.__all__])
import tensorflow as tf
if not issubclass(tfdp.DataParallelStrategy, tf.distribute.Strategy):
    missing.append("DataParallelStrategy is not a tf.distribute.Strategy")
if not issubclass(tfdp.ClusterConfigError, ValueError):
    missing.append("ClusterConfigError is not a ValueError")
if tfdp.schedules.WarmupCosineDecay is not tfdp.optimizers.schedules.WarmupCosineDecay:
    missing.append("tfdp.schedules is not tfdp.optimizers.schedules")
import tfdp.protocol
for n in ("EXIT_PREEMPTED", "READY_FILE_ENV", "CPU_REPLICAS_ENV"):
    if getattr(tfdp.cluster, n) is not getattr(tfdp.protocol, n):
        missing.append(f"tfdp.cluster.{n} is not tfdp.protocol's")
print(json.dumps(missing))
"""


def test_every_public_name_of_the_design_is_importable():
    result = _run(PUBLIC_NAMES)
    assert result.returncode == 0, result.stderr[-3000:]
    missing = json.loads(result.stdout.strip().splitlines()[-1])
    assert not missing, missing


def test_python_m_tfdp_run_help():
    result = _run("", "-m", "tfdp.run", "--help", timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tfdp-run" in result.stdout and "--workers" in result.stdout


def test_console_script_resolves_to_a_callable():
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    scripts = [line.strip() for line in
               config["options.entry_points"]["console_scripts"].strip().splitlines()]
    assert any(s.startswith("tfdp-run") for s in scripts), scripts
    for script in scripts:
        _, target = (part.strip() for part in script.split("=", 1))
        module, attribute = target.split(":")
        result = _run(f"""
            import importlib, sys
            target = importlib.import_module({module!r})
            for part in {attribute!r}.split("."):
                target = getattr(target, part)
            assert callable(target), target
            assert "tensorflow" not in sys.modules, "the launcher imported TensorFlow"
            """, timeout=60)
        assert result.returncode == 0, f"{script}: {result.stderr[-3000:]}"


# --- the doc ----------------------------------------------------------------------------------

def test_the_doc_names_every_module():
    text = DOC.read_text()

    def named(name, path):
        if str(path.relative_to(REPO)) in text:
            return True
        # the module name as a whole word: not a prefix of a longer dotted name
        return re.search(rf"(?<![\w.]){re.escape(name)}(?![\w]|\.\w)", text) is not None

    missing = [str(path.relative_to(REPO)) for name, path in tfdp_modules().items()
               if not named(name, path)]
    assert not missing, f"docs/architecture.md does not name: {missing}"



def unnamed_in_module_maps(root: pathlib.Path) -> dict:
    """``{package: [its modules its docstring does not name]}`` for every package under
    ``root`` but the top one (whose map is docs/architecture.md)."""
    missing = {}
    for init in sorted(root.rglob("__init__.py")):
        package = init.parent
        if package == root:
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        names = [p.stem for p in package.glob("*.py") if p.stem != "__init__"]
        names += [d.name for d in package.iterdir() if (d / "__init__.py").is_file()]
        unnamed = sorted(n for n in names
                         if not re.search(rf"(?<![\w]){re.escape(n)}(?!\w)", doc))
        if unnamed:
            missing[str(package.relative_to(root.parent))] = unnamed
    return missing


def test_every_package_docstring_maps_its_modules():
    missing = unnamed_in_module_maps(REPO / "tfdp")
    assert not missing, f"module maps (package docstrings) leave out: {missing}"


def test_guard_the_module_map_check_sees_a_module_left_out(tmp_path):
    package = tmp_path / "top" / "pkg"
    package.mkdir(parents=True)
    (tmp_path / "top" / "__init__.py").write_text("")
    (package / "__init__.py").write_text('"""``named``: one module."""\n')
    (package / "named.py").write_text("")
    (package / "left_out.py").write_text("")
    assert unnamed_in_module_maps(tmp_path / "top") == {"top/pkg": ["left_out"]}

# --- pure Python ------------------------------------------------------------------------------

def test_pure_python_parts_import_no_tensorflow():
    result = _run(f"""
        import json, sys
        for name in {PURE_PYTHON!r}:
            __import__(name)
        print(json.dumps(sorted(m for m in ("tensorflow", "keras") if m in sys.modules)))
        """, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def test_guard_the_pure_python_check_sees_tensorflow():
    result = _run("""
        import json, sys
        import tfdp.strategy.xla
        print(json.dumps(sorted(m for m in ("tensorflow", "keras") if m in sys.modules)))
        """, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == ["keras", "tensorflow"]


def test_the_version_is_the_changelogs_newest():
    text = (REPO / "CHANGELOG.md").read_text()
    newest = re.search(r"^## (\d+\.\d+\.\d+)", text, flags=re.M).group(1)
    init = (PACKAGE / "__init__.py").read_text()
    assert re.search(r'^__version__ = "([^"]+)"', init, flags=re.M).group(1) == newest
