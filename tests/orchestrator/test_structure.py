"""The code's shape, checked from its source: no import cycle (in the orchestrator, in fusedq,
or between the two; module by module, through a package's __init__, or between its
subpackages), the orchestrator's steps importing only the steps before them, a few modules at
its top, no overlong module or function.

All are read from the source (nothing is imported), so the checks cost milliseconds and keep
true what a review once had to draw by hand.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "orchestrator"
FUSEDQ = ROOT / "fusedq"
FUSEDQ_BENCH = ROOT / "fusedq_bench"
MAX_FUNCTION_LINES = 80
# A longer function stays only with a comment in it that argues its length.
LENGTH_ARGUED = "# long because"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(root: Path = PACKAGE) -> dict[str, Path]:
    return {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def import_graph(*roots: Path, through_packages: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of the packages at ``roots`` (the orchestrator by default) it
    imports, anywhere in it (a function-local or TYPE_CHECKING import hides a cycle from the
    interpreter, not from the design).

    `from pkg import sub` names the submodule; the implicit import of a module's own parent
    package is no edge (every package's __init__ would otherwise close a loop). With
    ``through_packages``, `from pkg import anything` is an edge to ``pkg`` too: its __init__
    runs first and is what is read, so a module that reaches a sibling through its own
    package's __init__ (which imports that module) closes a loop."""
    roots = roots or (PACKAGE,)
    modules = {name: path for root in roots for name, path in _modules(root).items()}
    tops = {root.name for root in roots}
    packages = {name for name, path in modules.items() if path.name == "__init__.py"}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    target = node.module or ""
                subs = {f"{target}.{a.name}" for a in node.names} & modules.keys()
                # Names that are not submodules come from the module itself.
                if len(subs) < len(node.names) or (through_packages and target in packages):
                    deps.add(target)
                deps |= subs
        graph[name] = {
            d for d in deps if d.split(".")[0] in tops and d in modules and d not in {name, *tops}
        }
    return graph


def package_graph(graph: dict[str, set[str]], *roots: Path) -> dict[str, set[str]]:
    """`graph` with every subpackage drawn as one node (its __init__ and all its modules); a
    module at the top of a root package stays a node of its own."""
    roots = roots or (PACKAGE,)
    subpackages = {
        _module_name(p.parent, root) for root in roots for p in root.glob("*/__init__.py")
    }

    def node(module: str) -> str:
        head = ".".join(module.split(".")[:2])
        return head if head in subpackages else module

    out: dict[str, set[str]] = {}
    for module, deps in graph.items():
        out.setdefault(node(module), set()).update(node(d) for d in deps)
    return {n: deps - {n} for n, deps in out.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_orchestrator_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "orchestrator.reports.html" in graph  # the walk found the packages' modules
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_no_module_reaches_a_sibling_through_its_packages_init() -> None:
    """A package's __init__ names its public parts; its own modules import each other
    directly, so the __init__ never runs half-done beneath one of them."""
    graph = import_graph(through_packages=True)
    assert "orchestrator.audit" in graph["orchestrator.execution.case_run"]  # the edge is drawn
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_orchestrators_subpackages_form_no_cycle() -> None:
    """Each step's package sits on one side of every other: common at the bottom, then the
    models, config, engines, audit, results, analysis, reports, plan, cluster and execution,
    with the CLI on top. The figures that judge a run (analysis) never import the reports
    that show them."""
    packages = package_graph(import_graph())
    assert {"orchestrator.audit", "orchestrator.reports"} <= packages.keys()
    assert "orchestrator.analysis" in packages["orchestrator.reports"]
    assert find_cycle(packages) is None, " -> ".join(find_cycle(packages) or [])


def test_fusedq_has_no_import_cycle() -> None:
    """Its kernel modules import fusedq.kernels.common and fusedq.contract, never each other;
    neither fusedq nor its bench has a cycle, module by module or through subpackages."""
    graph = import_graph(FUSEDQ)
    assert "fusedq.kernels.gluon_mla_query" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])
    for root in (FUSEDQ, FUSEDQ_BENCH):
        own = import_graph(root)
        assert find_cycle(own) is None, " -> ".join(find_cycle(own) or [])
        for packaged in (import_graph(root, through_packages=True), package_graph(own, root)):
            assert find_cycle(packaged) is None, " -> ".join(find_cycle(packaged) or [])
    kernels = {"triton_mla_query", "gluon_mla_query", "cute_mla_query"}
    for kernel in kernels:
        deps = {d.rpartition(".")[2] for d in graph[f"fusedq.kernels.{kernel}"]}
        assert deps <= {"common", "contract"}, (kernel, deps)


def test_no_import_cycle_across_fusedq_and_the_orchestrator() -> None:
    """The orchestrator deploys and drives fusedq (and runs its bench in gpu-check); fusedq
    imports nothing of either, and the bench nothing of the orchestrator, so the three packages
    form no cycle, module by module or as packages."""
    graph = import_graph(PACKAGE, FUSEDQ, FUSEDQ_BENCH)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])
    packages: dict[str, set[str]] = {}
    for module, deps in graph.items():
        top = module.split(".")[0]
        packages.setdefault(top, set()).update(
            d.split(".")[0] for d in deps if d.split(".")[0] != top
        )
    assert packages["orchestrator"] == {"fusedq", "fusedq_bench"}  # the edges it allows
    assert packages["fusedq_bench"] == {"fusedq"} and packages["fusedq"] == set()
    assert find_cycle(packages) is None, packages


def test_the_cycle_check_finds_a_cycle(tmp_path: Path) -> None:
    # The checker itself: a loop through a package's __init__ and a function-local import.
    pkg = tmp_path / "orchestrator"
    (pkg / "reports").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "compare.py").write_text("from orchestrator.reports import markdown\n")
    (pkg / "reports" / "__init__.py").write_text("")
    (pkg / "reports" / "markdown.py").write_text("from .run import Run\n")
    (pkg / "reports" / "run.py").write_text("def f():\n    from orchestrator import compare\n")
    assert find_cycle(import_graph(pkg)) == [
        "orchestrator.compare",
        "orchestrator.reports.markdown",
        "orchestrator.reports.run",
        "orchestrator.compare",
    ]
    (pkg / "reports" / "run.py").write_text("import json\n")
    assert find_cycle(import_graph(pkg)) is None


def test_the_package_checks_find_their_cycles(tmp_path: Path) -> None:
    # A loop only through a package's __init__, and one only between a subpackage and a
    # top-level module: neither is a cycle module by module.
    pkg = tmp_path / "orchestrator"
    (pkg / "audit").mkdir(parents=True)
    (pkg / "reports").mkdir()
    for init in (pkg, pkg / "audit", pkg / "reports"):
        (init / "__init__.py").write_text("")
    (pkg / "audit" / "__init__.py").write_text("from orchestrator.audit.scan import scan\n")
    (pkg / "audit" / "scan.py").write_text("from orchestrator.audit import sources\n")
    (pkg / "audit" / "sources.py").write_text("")
    (pkg / "compare.py").write_text("from orchestrator.reports.run import Run\n")
    (pkg / "reports" / "run.py").write_text("")
    (pkg / "reports" / "markdown.py").write_text("from orchestrator.compare import compare\n")
    assert find_cycle(import_graph(pkg)) is None
    assert find_cycle(import_graph(pkg, through_packages=True)) == [
        "orchestrator.audit",
        "orchestrator.audit.scan",
        "orchestrator.audit",
    ]
    assert find_cycle(package_graph(import_graph(pkg), pkg)) == [
        "orchestrator.compare",
        "orchestrator.reports",
        "orchestrator.compare",
    ]
    (pkg / "audit" / "scan.py").write_text("from orchestrator.audit.sources import x\n")
    (pkg / "reports" / "markdown.py").write_text("import json\n")
    assert find_cycle(import_graph(pkg, through_packages=True)) is None
    assert find_cycle(package_graph(import_graph(pkg), pkg)) is None


def test_test_modules_have_one_name_each() -> None:
    """Test folders hold no __init__.py, so pytest imports each test module (and the helpers
    tests import: orch_cli, audit_cases) by its file name alone: two files of one name, however
    far apart in tests/, cannot both load. conftest.py is the exception pytest makes."""
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name != "conftest.py":
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not list((ROOT / "tests").rglob("__init__.py"))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def _long_functions(root: Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source, str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            length = node.end_lineno - node.lineno + 1
            body = lines[node.lineno - 1 : node.end_lineno]
            if length > MAX_FUNCTION_LINES and not any(LENGTH_ARGUED in line for line in body):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} {length}")
    return found


def test_no_function_needs_more_than_a_screen() -> None:
    assert _long_functions() == [], (
        f"functions over {MAX_FUNCTION_LINES} lines: split them, or argue the length "
        f"in a '{LENGTH_ARGUED} ...' comment"
    )


def test_the_length_check_finds_a_long_function(tmp_path: Path) -> None:
    pkg = tmp_path / "orchestrator"
    pkg.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (pkg / "m.py").write_text(f"def long():\n{body}")
    assert _long_functions(pkg) == [f"orchestrator/m.py:1 long {MAX_FUNCTION_LINES + 1}"]
    (pkg / "m.py").write_text(f"def long():\n    {LENGTH_ARGUED} it is a table\n{body}")
    assert _long_functions(pkg) == []


# The shape a newcomer reads from the tree: a few modules at the orchestrator's top (the CLI
# and the version; every step in its package) and modules that fit in one reading.
MAX_TOP_LEVEL_MODULES = 12
MAX_MODULE_LINES = 600


def _long_modules(*roots: Path) -> list[str]:
    """Modules over MAX_MODULE_LINES. Only a kernel module (fusedq/kernels/) may argue its
    length, in a top-level '# long because' comment: one kernel, its layouts and its launch
    read best together."""
    found = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            lines = path.read_text().splitlines()
            kernel = root.name == "fusedq" and path.relative_to(root).parts[0] == "kernels"
            argued = kernel and any(line.startswith(LENGTH_ARGUED) for line in lines)
            if len(lines) > MAX_MODULE_LINES and not argued:
                found.append(f"{path.relative_to(root.parent)} {len(lines)}")
    return found


def test_the_orchestrators_top_holds_few_modules() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert "cli.py" in top  # the glob sees the package
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} modules at the top: {top}"


def test_no_module_needs_more_than_a_reading() -> None:
    long = _long_modules(PACKAGE, FUSEDQ, FUSEDQ_BENCH)
    assert long == [], (
        f"modules over {MAX_MODULE_LINES} lines: split them by what each part owns (a kernel "
        f"module may argue its length in a top-level '{LENGTH_ARGUED} ...' comment)"
    )


def test_the_module_length_check_finds_a_long_module(tmp_path: Path) -> None:
    long = "x = 1\n" * (MAX_MODULE_LINES + 1)
    for package in ("orchestrator", "fusedq/kernels"):
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "m.py").write_text(long)
    assert _long_modules(tmp_path / "orchestrator") == [f"orchestrator/m.py {MAX_MODULE_LINES + 1}"]
    assert _long_modules(tmp_path / "fusedq") == [f"fusedq/kernels/m.py {MAX_MODULE_LINES + 1}"]
    argued = f"{LENGTH_ARGUED} it is one kernel\n{long}"
    (tmp_path / "fusedq" / "kernels" / "m.py").write_text(argued)
    (tmp_path / "orchestrator" / "m.py").write_text(argued)
    assert _long_modules(tmp_path / "fusedq") == []
    assert _long_modules(tmp_path / "orchestrator") == [f"orchestrator/m.py {MAX_MODULE_LINES + 2}"]


# The orchestrator's steps, lowest first: a package imports only packages before it
# (docs/README.md's tour reads them in this order).
LAYERS = (
    "common",
    "models",
    "config",
    "engines",
    "audit",
    "results",
    "client",
    "analysis",
    "reports",
    "plan",
    "cluster",
    "execution",
)


def test_each_step_imports_only_the_steps_before_it() -> None:
    packages = package_graph(import_graph())
    subpackages = {
        n.split(".")[1]
        for n in packages
        if n.count(".") == 1 and (PACKAGE / n.split(".")[1]).is_dir()
    }
    assert subpackages == set(LAYERS), subpackages ^ set(LAYERS)
    upward = [
        f"{node} -> {dep}"
        for node, deps in sorted(packages.items())
        for dep in sorted(deps)
        if node.count(".") == 1
        and dep.count(".") == 1
        and node.split(".")[1] in LAYERS
        and dep.split(".")[1] in LAYERS
        and LAYERS.index(dep.split(".")[1]) > LAYERS.index(node.split(".")[1])
    ]
    assert upward == []


# What fusedq.contract may import: it is read where torch is absent or too slow to load.
CONTRACT_IMPORTS = {"__future__", "dataclasses"}


def _top_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.partition(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." if node.level else (node.module or "").partition(".")[0])
    return names


def test_fusedq_contract_imports_only_the_standard_library() -> None:
    assert _top_imports(FUSEDQ / "contract.py") <= CONTRACT_IMPORTS


def test_fusedq_contract_loads_without_torch() -> None:
    """In a fresh interpreter, ``import fusedq.contract`` (through fusedq's lazy __init__)
    and the orchestrator's planning path leave torch and Triton unloaded."""
    import subprocess
    import sys

    probe = (
        "import sys, fusedq.contract, fusedq.provenance, orchestrator.cli, "
        "orchestrator.plan.render, orchestrator.config.expand\n"
        "print(sorted(m for m in ('torch', 'triton', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_import_check_sees_a_torch_import(tmp_path: Path) -> None:
    module = tmp_path / "contract.py"
    module.write_text("from __future__ import annotations\ndef f():\n    import torch\n")
    assert "torch" in _top_imports(module)


# The steps that drive a server reach its engine only through orchestrator.engines (the
# registry and the interface): a second engine is a package beside engines/vllm/ and a row.
ENGINE_BLIND = ("plan", "cluster", "execution")


def _engine_reachers(graph: dict[str, set[str]], engine: str = "vllm") -> list[str]:
    """The ENGINE_BLIND steps' imports of one engine's package, anywhere in a module."""
    package = f"orchestrator.engines.{engine}"
    return [
        f"{module} -> {dep}"
        for module, deps in sorted(graph.items())
        if module.split(".")[1:2] and module.split(".")[1] in ENGINE_BLIND
        for dep in sorted(deps)
        if dep == package or dep.startswith(f"{package}.")
    ]


def test_the_steps_that_drive_servers_reach_engines_only_through_the_registry() -> None:
    graph = import_graph()
    assert "orchestrator.engines" in graph["orchestrator.execution.case_run"]  # the seam is used
    assert _engine_reachers(graph) == []


def test_the_engine_check_finds_a_step_that_reaches_past_the_registry(tmp_path: Path) -> None:
    pkg = tmp_path / "orchestrator"
    for sub in ("engines/vllm", "cluster", "execution"):
        (pkg / sub).mkdir(parents=True)
    for init in ("", "engines", "engines/vllm", "cluster", "execution"):
        (pkg / init / "__init__.py").write_text("")
    (pkg / "engines" / "vllm" / "server.py").write_text("")
    (pkg / "cluster" / "actor.py").write_text(
        "def f():\n    from orchestrator.engines.vllm.server import start\n"
    )
    (pkg / "execution" / "run.py").write_text("from orchestrator.engines import engine_for\n")
    assert _engine_reachers(import_graph(pkg)) == [
        "orchestrator.cluster.actor -> orchestrator.engines.vllm.server"
    ]
