"""The package's layers (DESIGN.md section 1, docs/architecture.md), read from the code's imports.

Every import of every module is read with ``ast`` (those inside functions and ``TYPE_CHECKING`` blocks
too), so a circle or an upward import cannot hide behind a lazy import.
"""

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "faucet_dagster"

LAYERS: dict[str, int] = {
    "protocol": 0,
    "planner": 1,
    "pipeline": 1,
    "runner": 1,
    "state": 1,
    "verify": 1,
    "declarations": 2,
    "syncs": 2,
    "streams": 2,
    "components": 2,
    "cli": 3,
}
"""What each entry of the package root belongs to: 0 the protocol, 1 the engine, 2 the Dagster
integration, 3 the command line. A layer imports only its own and the ones below it."""
BESIDE: dict[str, set[str]] = {
    "testing": {"protocol", "planner", "pipeline", "runner", "state", "verify"},
    "conformance": {"protocol", "planner", "pipeline", "runner", "state", "verify", "testing"},
}
"""The battery and the test support stand beside the layers: what each may import."""
OURS = {"faucet_dagster", *(path.name for path in (ROOT / "connectors").iterdir() if path.is_dir())}
"""The package and its connectors: the modules whose imports must not run in a circle."""
DAGSTER_FACING = {"declarations", "syncs", "streams", "components"}
DAGSTER_PACKAGES = {"dagster", "dagster_shared", "dagster_dg_cli", "dagster_graphql", "dagster_webserver"}


@dataclass(frozen=True)
class Import:
    path: Path
    line: int
    module: str  # the imported module, resolved to the deepest module that exists

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line} imports {self.module}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str) -> bool:
    for root in (ROOT, ROOT / "connectors"):
        base = root.joinpath(*name.split("."))
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            return True
    return False


def imports(path: Path) -> Iterator[Import]:
    """Every import in ``path``; ``from a import b`` names ``a.b`` when that is a module of the tree."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(path, node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield Import(path, node.lineno, full if is_module(full) else base)


def package_files(*parts: str) -> list[Path]:
    files: list[Path] = []
    for part in parts:
        path = ROOT / part
        files.extend([path] if path.is_file() else sorted(path.rglob("*.py")))
    return files


def top_of(module: str) -> str | None:
    """The package-root entry ``module`` belongs to (``faucet_dagster.runner.lease`` -> ``runner``)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "faucet_dagster" and len(parts) > 1 else None


def test_the_package_root_holds_the_layers_and_nothing_else() -> None:
    entries = {
        path.stem if path.suffix == ".py" else path.name
        for path in PACKAGE.iterdir()
        if path.name not in ("__init__.py", "py.typed", "__pycache__")
    }
    assert entries <= set(LAYERS) | set(BESIDE), sorted(entries - set(LAYERS) - set(BESIDE))


def test_each_layer_imports_only_its_own_and_the_layers_below_it() -> None:
    offences = []
    for path in package_files("faucet_dagster"):
        here = top_of(module_name(path))
        for found in imports(path):
            there = top_of(found.module)
            if here is None or there is None or here == there:
                continue
            if here == "cli":
                allowed = True  # the top: every command may use any part of the package
            elif here in BESIDE:
                allowed = there in BESIDE[here]
            else:
                allowed = there in LAYERS and LAYERS[there] <= LAYERS[here]
            if not allowed:
                offences.append(str(found))
    assert not offences, "\n".join(offences)


def test_only_the_dagster_integration_imports_dagster() -> None:
    offences = [
        str(found)
        for path in package_files("faucet_dagster", "connectors")
        if top_of(module_name(path)) not in DAGSTER_FACING
        for found in imports(path)
        if found.module.split(".")[0] in DAGSTER_PACKAGES
    ]
    assert not offences, "\n".join(offences)


def test_connectors_import_only_the_protocol_from_faucet_dagster() -> None:
    offences = [
        str(found)
        for path in package_files("connectors")
        for found in imports(path)
        if found.module.startswith("faucet_dagster") and top_of(found.module) != "protocol"
    ]
    assert not offences, "\n".join(offences)


def test_no_import_circle_anywhere_in_the_package_or_the_connectors() -> None:
    graph: dict[str, set[str]] = {}
    for path in package_files("faucet_dagster", "connectors"):
        name = module_name(path).removeprefix("connectors.")
        graph.setdefault(name, set()).update(
            found.module.removeprefix("connectors.")
            for found in imports(path)
            if found.module.split(".")[0] in OURS
        )
    circles = [component for component in strongly_connected(graph) if len(component) > 1]
    circles += [[name] for name, targets in graph.items() if name in targets]
    assert not circles, "\n".join(" -> ".join(sorted(circle)) for circle in circles)


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph`` (iterative: the package is deep)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in graph:
                    continue
                if target not in index:
                    index[target] = low[target] = counter
                    counter += 1
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(component)
    return components
