"""The installed distribution: one top-level import name (`raylane`), imports that only go down
the layers, no import circles, the one-line public API, and Hugging Face's `kernels` beside it.

The import graph is read from the source with `ast` (every `import`, at module level or inside
a function), not from what happens to be imported at run time, so a circle hidden behind a
function-level import still counts."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _setup_folders() -> dict[str, str]:
    """Folder at the repo root -> its import name: the FOLDERS literal setup.py installs."""
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "FOLDERS":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no FOLDERS mapping")


FOLDERS = _setup_folders()
# the layers, lowest first: a module may import its own layer and the ones below it
LAYERS = ["raylane.kernels", "raylane.actors", "raylane.router", "raylane.session_server"]


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for folder, name in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([name, *parts])] = path
    return mods


MODULES = _modules()


def _imported_names(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) for every absolute import in the file, `from a import b` giving both
    `a` and `a.b` (b may be a submodule)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append((node.lineno, node.module))
            names += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return names


def _internal(name: str) -> str | None:
    """The raylane module `name` resolves to (longest known prefix), or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for mod, path in MODULES.items():
        deps = {_internal(name) for _, name in _imported_names(path)}
        graph[mod] = {d for d in deps if d is not None and d != mod and d != "raylane"}
    return graph


def _layer(mod: str) -> int:
    for rank, prefix in enumerate(LAYERS):
        if mod == prefix or mod.startswith(prefix + "."):
            return rank
    return len(LAYERS)  # the top: cluster/'s own modules


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_tarjan_finds_circles_and_only_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": {"f", "a"}}
    assert sorted(strongly_connected(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert strongly_connected({"x": {"y"}, "y": set()}) == []


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel `pip wheel` builds from this checkout."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["--disable-pip-version-check", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (path,) = out.glob("raylane-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_installs_exactly_one_top_level_name(wheel):
    files = wheel.namelist()
    tops = {f.split("/")[0] for f in files if ".dist-info/" not in f}
    assert tops == {"raylane"}
    # every module in the card's folders is in it, under its raylane name
    shipped = {f.removesuffix(".py").replace("/", ".") for f in files if f.endswith(".py")}
    expected = {f"{m}.__init__" if p.name == "__init__.py" else m for m, p in MODULES.items()}
    assert expected <= shipped, sorted(expected - shipped)


USER_BENCHES = {"throughput", "serve", "spec", "weights"}  # `raylane bench`; the rest: benchmarks/


def _bench_closure() -> set[str]:
    """raylane.bench and the bench modules the four user benchmarks import, transitively."""
    graph, seen = _graph(), {"raylane.bench"}
    todo = [f"raylane.bench.{name}" for name in USER_BENCHES]
    while todo:
        mod = todo.pop()
        if mod not in seen:
            seen.add(mod)
            todo += [d for d in graph[mod] if d.startswith("raylane.bench.")]
    return seen


def test_the_wheel_ships_the_four_benchmarks_and_no_test_code(wheel):
    from raylane.cli import BENCHES

    assert set(BENCHES) == USER_BENCHES
    modules = [f.removesuffix(".py") for f in wheel.namelist() if f.endswith(".py")]
    bench = {m.replace("/", ".").removesuffix(".__init__") for m in modules}
    bench = {m for m in bench if m.startswith("raylane.bench")}
    assert bench == _bench_closure()  # no benchmark nothing installed runs
    test_code = [m for m in modules if "fake" in m.rsplit("/", 1)[-1] or "pgtemp" in m]
    assert test_code == []
    # aiohttp and psutil are the bench extra's, not every install's
    (metadata,) = [f for f in wheel.namelist() if f.endswith(".dist-info/METADATA")]
    requires = [
        line.removeprefix("Requires-Dist: ")
        for line in wheel.read(metadata).decode().splitlines()
        if line.startswith("Requires-Dist: ")
    ]
    core = {r.split(";")[0].strip() for r in requires if "extra ==" not in r}
    assert not core & {"aiohttp", "psutil"}
    assert {'aiohttp; extra == "bench"', 'psutil; extra == "bench"'} <= set(requires)


def test_no_installed_module_imports_what_is_not_installed():
    found = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in MODULES.values()
        for line, name in _imported_names(path)
        if name.split(".")[0] in ("benchmarks", "tests")
    ]
    assert found == []


def test_bench_serve_without_the_extra_says_how_to_install_it(monkeypatch):
    from raylane.cli import main

    monkeypatch.setitem(sys.modules, "aiohttp", None)  # as if not installed
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "serve", "--skip-offline"])
    assert "aiohttp" in str(exit_.value) and "pip install 'raylane[bench]'" in str(exit_.value)


def test_no_module_imports_a_bare_folder_name():
    bare = {"cluster", "actors", "kernels", "router", "session_server"}
    assert bare == set(FOLDERS)
    found = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in MODULES.values()
        for line, name in _imported_names(path)
        if name.split(".")[0] in bare
    ]
    assert found == []


def test_lower_layers_never_import_higher_ones():
    found = [
        f"{mod} -> {dep}"
        for mod, deps in _graph().items()
        for dep in sorted(deps)
        if _layer(dep) > _layer(mod)
    ]
    assert found == []


def test_no_import_circles():
    circles = strongly_connected(_graph())
    assert circles == [], "modules that import each other: " + "; ".join(map(str, circles))


def _run(code: str) -> str:
    """`code` in a fresh interpreter, outside the repo (so only the installed package imports)."""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_one_line_import_gives_the_engine_classes():
    out = _run(
        "import sys\n"
        "import raylane\n"
        "print(sorted(m.split('.')[0] for m in sys.modules if m.split('.')[0] in "
        "('torch', 'ray', 'transformers')))\n"
        "from raylane import LLMEngine, EngineConfig, SamplingParams, AsyncLLMEngine, "
        "RolloutClient\n"
        "from raylane.actors.engine.llm_engine import LLMEngine as L\n"
        "from raylane.client.rollout_client import RolloutClient as R\n"
        "print(LLMEngine is L, RolloutClient is R, SamplingParams(max_tokens=3).max_tokens)\n"
    )
    assert out.splitlines() == ["[]", "True True 3"]  # `import raylane` alone pulls none


def test_raylane_kernels_does_not_pull_the_engine_or_torch():
    out = _run(
        "import sys\n"
        "import raylane.kernels\n"
        "print(sorted(m for m in sys.modules if m.startswith(('raylane', 'torch', 'ray.'))))\n"
    )
    assert out.strip() == "['raylane', 'raylane.kernels']"


def test_the_router_process_imports_no_torch():
    """The Router only routes and keeps registries: its actor module, the control plane and
    the weight-update wire format it reads load without torch."""
    out = _run(
        "import sys\n"
        "import raylane.router.actor, raylane.router.control, raylane.actors.models.weights\n"
        "print('torch' in sys.modules)\n"
    )
    assert out.strip() == "False"


def test_hugging_face_kernels_beside_raylane():
    pytest.importorskip("kernels", reason="Hugging Face's `kernels` is in the test extra")
    out = _run(
        "import kernels\n"
        "import torch\n"
        "from raylane.kernels.norm import rms_norm\n"
        "import transformers\n"
        "print(callable(kernels.get_kernel), 'site-packages' in kernels.__file__)\n"
        "x = torch.tensor([[3.0, 4.0]])\n"
        "w = torch.tensor([1.0, 2.0])\n"
        "print(rms_norm(x, w, 0.0).tolist())\n"
    )
    lines = out.splitlines()
    assert lines[0] == "True True"
    # rms of (3, 4) is sqrt(12.5): (3, 4) / 3.5355... * (1, 2)
    got = [float(v) for v in lines[1].strip("[]").split(",")]
    assert got == pytest.approx([3 / 12.5**0.5, 8 / 12.5**0.5], rel=1e-6)
