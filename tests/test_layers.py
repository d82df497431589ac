"""The house in layers: no import circles, small modules, no private names across packages,
lower layers never import higher ones, and ``import cudagraphs`` stays light."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cudagraphs as cg

SRC = Path(__file__).resolve().parents[1] / "src" / "cudagraphs"
# Each layer may import only the layers before it.
LAYERS = [
    "lazy",
    "workers",
    "errors",
    "options",
    "core",
    "control",
    "shapes",
    "training",
    "diagnose",
    "api",
    "integrations",
    "decoding",
    "serve",
    "tools",
]
SAME_FLOOR = {("shapes", "training"), ("training", "shapes")}


def _modules() -> dict[str, Path]:
    return {
        ".".join(path.relative_to(SRC.parent).with_suffix("").parts): path
        for path in SRC.rglob("*.py")
    }


def _imports(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """``(imported module, names)`` for every import in the file, resolved to absolute names."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")
            base = base[: len(base) - node.level + 1]
            module = ".".join([*base, node.module] if node.module else base)
            found.append((module, [a.name for a in node.names]))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cudagraphs"):
            found.append((node.module or "", [a.name for a in node.names]))
    return found


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_opens_with_the_idea_it_holds() -> None:
    """One idea per module, said first: each module's docstring opens with a sentence (a
    module is split by responsibility, not cut to a line count)."""
    unsaid = []
    for name, path in _modules().items():
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if len(doc.strip().splitlines()[0].split() if doc.strip() else []) < 3:
            unsaid.append(name)
    assert unsaid == []


def test_no_private_name_is_imported_across_modules() -> None:
    offenders = []
    for name, path in _modules().items():
        package = name.rpartition(".")[0]
        for module, names in _imports(name, path):
            if module == package:
                continue  # a private module of one's own package (the compiled extension)
            offenders += [f"{name}: from {module} import {n}" for n in names if n.startswith("_")]
    assert offenders == []


def test_lower_layers_never_import_higher_ones() -> None:
    offenders = []
    for name, path in _modules().items():
        mine = _layer(name)
        if mine in ("__init__", "__main__"):
            continue
        for module, _ in _imports(name, path):
            theirs = _layer(module)
            if theirs in ("__init__",) or theirs == mine or (mine, theirs) in SAME_FLOOR:
                continue
            if LAYERS.index(theirs) > LAYERS.index(mine):
                offenders.append(f"{name} ({mine}) imports {module} ({theirs})")
    assert offenders == []


def test_no_import_circle_between_modules() -> None:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for module, names in _imports(name, path):
            for target in (module, *(f"{module}.{n}" for n in names)):
                if target in graph and target != name:
                    graph[name].add(target)
    visiting: list[str] = []
    done: set[str] = set()

    def visit(node: str) -> None:
        if node in done:
            return
        if node in visiting:
            pytest.fail("import circle: " + " -> ".join([*visiting[visiting.index(node) :], node]))
        visiting.append(node)
        for nxt in sorted(graph[node]):
            if not nxt.endswith("__init__") and nxt != "cudagraphs":
                visit(nxt)
        visiting.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)


@pytest.mark.slow
def test_import_cudagraphs_loads_no_tools_and_no_rich() -> None:
    code = (
        "import sys, cudagraphs; "
        "heavy = [m for m in sys.modules if m.startswith(('rich', 'cudagraphs.tools'))]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    assert callable(cg.bench) and cg.Profile.__name__ == "Profile"  # still there, on first use


@pytest.mark.parametrize(
    ("kwargs", "suggestion"),
    [({"warmpu": 3}, "warmup"), ({"output": "clone"}, "outputs"), ({"verfy": True}, "verify")],
)
def test_a_misspelt_option_says_which_one_was_meant(kwargs: dict, suggestion: str) -> None:
    def step(x):  # type: ignore[no-untyped-def]
        return x

    with pytest.raises(cg.ConfigError, match=f"did you mean {suggestion}=") as error:
        cg.graph(step, **kwargs)
    assert "is not an option" in str(error.value)


def test_a_keyword_the_function_takes_is_an_example_not_a_typo() -> None:
    def step(x, *, output=1.0):  # type: ignore[no-untyped-def]
        return x * output

    import torch

    g = cg.graph(step, torch.ones(2), output=2.0)  # CPU: a pass-through with the same checks
    assert g.input_kwargs == {"output": 2.0}


def test_train_step_refuses_options_it_does_not_take() -> None:
    import torch

    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(cg.ConfigError, match="did you mean warmup="):
        cg.train_step(lambda x: x, optimizer=opt, warmpu=2)
    with pytest.raises(cg.ConfigError, match="unknown option verify"):
        cg.train_step(lambda x: x, optimizer=opt, verify=True)


def test_config_error_hint_suggests_the_default() -> None:
    with pytest.raises(cg.ConfigError, match="pass outputs='guarded' \\(the default\\)"):
        cg.graph(lambda x: x, outputs="copy")


# Private torch names: ``torch._X`` / ``torch.cuda._X`` attributes, the dispatcher's
# ``_schema``, version counters, optimizer internals, and private torch modules.
_PRIVATE_TORCH = re.compile(
    r"torch(\.[A-Za-z]\w*)*\._[A-Za-z]|\._version\b|\._schema\b|\._cdata\b"
    r"|_step_supports_amp_scaling|_need_device_dtype_check|torch\.utils\._"
)


def test_private_torch_names_are_used_only_in_the_doorway_module() -> None:
    """Every private PyTorch name goes through ``core/compat.py`` (one place to gate and
    update when PyTorch changes); comments and docstrings do not count."""
    offenders = []
    for name, path in _modules().items():
        if name == "cudagraphs.core.compat":
            continue
        source = path.read_text()
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Attribute, ast.ImportFrom, ast.Import)):
                text = ast.unparse(node)
                if _PRIVATE_TORCH.search(text):
                    offenders.append(f"{path.relative_to(SRC)}:{node.lineno}: {text}")
    assert sorted(set(offenders)) == []


def test_the_doorway_check_sees_a_private_name() -> None:
    """The check above is not vacuous: a use planted in a module's source is found."""
    planted = ast.parse("x = torch._C._cuda_clearCublasWorkspaces()\ny = t._version")
    found = [
        ast.unparse(n)
        for n in ast.walk(planted)
        if isinstance(n, ast.Attribute) and _PRIVATE_TORCH.search(ast.unparse(n))
    ]
    assert "torch._C._cuda_clearCublasWorkspaces" in found and "t._version" in found


class _Model(__import__("torch").nn.Module):
    def forward(self, x):  # type: ignore[no-untyped-def]
        return x * 2


@pytest.mark.parametrize("entry", ["graph", "graph_autograd"])
@pytest.mark.parametrize("kind", ["module", "function"])
def test_a_misspelt_option_is_refused_with_the_suggestion(entry: str, kind: str) -> None:
    import torch

    fn = _Model() if kind == "module" else (lambda x: x * 2)
    with pytest.raises(cg.ConfigError, match="did you mean warmup="):
        getattr(cg, entry)(fn, torch.ones(2), warmpu=5)


def test_train_step_refuses_a_misspelt_option() -> None:
    import torch

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(cg.ConfigError, match="did you mean warmup="):
        cg.train_step(lambda x: model(x).sum(), optimizer=opt, warmpu=5)


def test_the_decoder_and_the_batcher_refuse_a_misspelt_option() -> None:
    import torch

    from cudagraphs.decoding.decoder import Decoder

    with pytest.raises(cg.ConfigError, match="did you mean max_wait_ms="):
        cg.Batcher(lambda x: x, torch.ones(1, 2), max_batch=4, max_wait=5)
    with pytest.raises(cg.ConfigError, match="did you mean steps_per_graph="):
        Decoder(object(), max_batch=1, max_length=16, steps_per_grph=4)  # before the model


def _torch_attribute_writes(tree: ast.AST) -> list[str]:
    """Assignments to an attribute reached from ``torch`` or ``nn`` (``nn.Module._apply = f``,
    ``torch.cuda.synchronize = f``) and ``setattr(torch..., ...)`` calls."""

    def rooted(node: ast.AST) -> bool:
        while isinstance(node, ast.Attribute):
            node = node.value
        return isinstance(node, ast.Name) and node.id in ("torch", "nn")

    found = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr":
            targets = [ast.Attribute(value=node.args[0], attr="?")] if node.args else []
        found += [ast.unparse(t) for t in targets if isinstance(t, ast.Attribute) and rooted(t)]
    return found


def test_no_torch_attribute_is_replaced_outside_the_doctors_watches() -> None:
    """No process-wide patch: nothing in the library assigns to torch's or nn's attributes,
    except the doctor's watches (thread-confined, undone on the way out)."""
    offenders = []
    for name, path in _modules().items():
        if name == "cudagraphs.diagnose.watches":
            continue
        offenders += [f"{name}: {w}" for w in _torch_attribute_writes(ast.parse(path.read_text()))]
    assert offenders == []


def test_the_patch_check_sees_a_patch() -> None:
    planted = ast.parse("nn.Module._apply = f\nsetattr(torch.cuda, 'synchronize', g)\nx.y = 1")
    assert _torch_attribute_writes(planted) == ["nn.Module._apply", "torch.cuda.?"]


def test_the_core_alone_refuses_verification_instead_of_skipping_it() -> None:
    from cudagraphs.core import Diagnostics

    Diagnostics().verify(object(), 0)  # nothing asked, nothing done
    with pytest.raises(cg.ConfigError, match="verifier is not loaded"):
        Diagnostics().verify(object(), 3)


CORE = ("errors", "options", "core", "shapes", "api")
ADD_ONS = ("training", "control", "serve", "integrations", "decoding", "diagnose", "tools")


def _public(module: str) -> set[str] | None:
    """The names a package's ``__init__`` declares in ``__all__`` (a list, or ``sorted(D)`` of a
    dict ``D`` of lazily loaded names); None where the module does not exist."""
    path = _modules().get(module)
    if path is None:
        return None
    body = ast.parse(path.read_text()).body
    assigned = {
        t.id: node.value
        for node in body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(t, ast.Name) and node.value is not None
    }
    value = assigned.get("__all__")
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.args:
        value = assigned.get(getattr(value.args[0], "id", ""), value.args[0])  # sorted(D)
    if isinstance(value, ast.Dict):
        return {ast.literal_eval(k) for k in value.keys if k is not None}
    if isinstance(value, (ast.List, ast.Tuple)):
        return {ast.literal_eval(e) for e in value.elts}
    return set()


PACKAGES = sorted(p.parent.name for p in SRC.glob("*/__init__.py"))


def surface_violations(modules: dict[str, Path] | None = None) -> list[str]:
    """Imports that pass a package's front door: a module of another package imported from
    (``from cudagraphs.shapes.bucketed import Bucketed``), a name its ``__init__``'s
    ``__all__`` does not list, or the top-level package imported from inside a package (it
    imports every package: a circle in waiting)."""
    modules = _modules() if modules is None else modules
    public = {p: _public(f"cudagraphs.{p}.__init__") or set() for p in PACKAGES}
    offenders = []
    for name, path in modules.items():
        parts = name.split(".")
        mine = parts[1] if len(parts) > 2 else None  # a module of a package, or a top module
        for module, names in _imports(name, path):
            target = module.split(".")
            if module == "cudagraphs" and mine is not None:
                offenders.append(f"{name}: imports the top-level package cudagraphs")
            if len(target) < 2 or target[1] not in PACKAGES or target[1] == mine:
                continue
            if len(target) > 2:
                offenders.append(f"{name}: imports {module}")
            else:
                offenders += [
                    f"{name}: from {module} import {n}" for n in names if n not in public[target[1]]
                ]
    return offenders


def test_every_package_has_a_front_door() -> None:
    """Each package's ``__init__`` declares its public names in ``__all__``, and has them."""
    import importlib

    every = ["control", "core", "decoding", "diagnose", "integrations", "serve", "shapes"]
    assert [*every, "tools", "training"] == PACKAGES
    for package in PACKAGES:
        public = _public(f"cudagraphs.{package}.__init__")
        assert public, f"cudagraphs.{package} declares no __all__"
        module = importlib.import_module(f"cudagraphs.{package}")
        assert sorted(public) == sorted(module.__all__)
        missing = [
            n for n in public if package not in ("integrations", "tools") and not hasattr(module, n)
        ]
        assert missing == [], f"cudagraphs.{package} declares {missing} but has none"


def test_other_packages_import_only_through_each_front_door() -> None:
    """Every module imports another package's names from that package (``from ..shapes import
    Bucketed``), only those its ``__all__`` declares, never from its modules."""
    assert surface_violations() == []


def test_the_front_door_check_sees_an_import_past_a_door(tmp_path: Path) -> None:
    """The check above is not vacuous: planted imports of a module of the core and of another
    add-on, of a name a door does not declare, and of the top-level package, are all found,
    and an import inside one's own package is not."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from ..core.capture import warm_up\nfrom ..core import Replayer\nfrom ..core import eager\n"
        "from ..diagnose.doctor import doctor\nfrom ..training import TrainStep\n"
        "from ..training import OptimizerWatch\nfrom .spec import Buckets\nimport cudagraphs\n"
        "from .. import api\n"
    )
    found = surface_violations({"cudagraphs.shapes.planted": planted})
    assert found == [
        "cudagraphs.shapes.planted: imports cudagraphs.core.capture",
        "cudagraphs.shapes.planted: from cudagraphs.core import Replayer",
        "cudagraphs.shapes.planted: imports cudagraphs.diagnose.doctor",
        "cudagraphs.shapes.planted: from cudagraphs.training import OptimizerWatch",
        "cudagraphs.shapes.planted: imports the top-level package cudagraphs",
    ]


def test_the_core_has_a_front_door_with_every_name_it_declares() -> None:
    public = _public("cudagraphs.core.__init__")
    assert public and all(hasattr(__import__("cudagraphs.core").core, n) for n in public)


def core_import_edges() -> int:
    """Import edges between the core's modules (the figure DESIGN.md gives)."""
    modules = {n: p for n, p in _modules().items() if n.startswith("cudagraphs.core.")}
    edges = set()
    for name, path in modules.items():
        if name.endswith("__init__"):
            continue
        for module, names in _imports(name, path):
            for target in (module, *(f"{module}.{n}" for n in names)):
                if target in modules and target != name:
                    edges.add((name, target))
    return len(edges)


@pytest.mark.slow
def test_importing_the_package_without_numpy_prints_nothing() -> None:
    """numpy is optional: without it, ``import cudagraphs`` (which imports torch) shows no
    "Failed to initialize NumPy" warning."""
    code = "import sys; sys.modules['numpy'] = None; import cudagraphs"
    done = subprocess.run(
        [sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "NumPy" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (lambda m, x: cg.graph(m, x, bucket={"B": [1, 2]}), "did you mean buckets="),
        (lambda m, x: cg.graph(m, x, max_graph=4), "did you mean max_graphs="),
        (
            lambda m, x: cg.graph(m, x, buckets={"B": [2]}, overflow="eager"),
            "belongs to cg.Buckets",
        ),
        (
            lambda m, x: cg.graph(m, x, buckets={"B": [2]}, lazzy=True),
            "did you mean lazy=, an option of cg.Buckets",
        ),
        (lambda m, x: cg.graph(m, x, colour="red"), "'colour' is not an option of cg.graph"),
        (lambda m, x: cg.Buckets({"B": [2]}, overflw="eager"), "did you mean overflow="),
        (
            lambda m, x: cg.graph_autograd(m, x, bucket=[1]),
            "'bucket' is not an option of cg.graph_autograd",
        ),
    ],
    ids=["bucket", "max_graph", "overflow", "lazzy", "unknown", "Buckets", "graph_autograd"],
)
def test_every_misspelt_or_misplaced_keyword_is_refused_at_once(call, expected: str) -> None:  # type: ignore[no-untyped-def]
    """A keyword is an option of the entry point or an argument the function takes; anything
    else is refused when the graph is made (not frozen as an example argument the first call
    trips over), with the option meant or the place it belongs."""
    import torch

    with pytest.raises(cg.ConfigError, match=re.escape(expected)):
        call(_Model(), torch.ones(2, 2))


def test_the_decoder_names_a_misspelt_required_keyword_and_its_compile_modes() -> None:
    from cudagraphs.decoding.decoder import Decoder

    with pytest.raises(cg.ConfigError, match="did you mean max_length="):
        Decoder(object(), max_batch=2, max_lenght=32)  # before Python's "missing max_length"
    pytest.importorskip("transformers")
    from llama_decode import tiny_llama

    model, _ = tiny_llama("cpu", hidden=32, layers=1)
    with pytest.raises(cg.ConfigError, match=r"torch.compile mode name.*max-autotune.*got 'yes'"):
        Decoder(model, max_batch=2, max_length=16, compile="yes")


def test_design_md_gives_the_cores_module_and_edge_counts_as_they_are() -> None:
    design = (SRC.parents[1] / "DESIGN.md").read_text()
    found = re.search(r"\((\d+) modules and (\d+) import edges between them", design)
    assert found, "DESIGN.md: the core's counts are missing"
    modules = len([p for p in (SRC / "core").glob("*.py") if p.name != "__init__.py"])
    assert (int(found.group(1)), int(found.group(2))) == (modules, core_import_edges())
