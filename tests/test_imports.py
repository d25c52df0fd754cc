"""Every `from specdecode... import name` in the package, the scripts kept beside their records in docs/bench/ and
docs/layers.py names something that exists, including the imports inside functions that only run on some paths (a
renamed module or a moved function breaks no other test there)."""
import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specdecode"
SOURCES = [*sorted(PACKAGE.rglob("*.py")), *sorted((ROOT / "docs" / "bench").rglob("*.py")),
           ROOT / "docs" / "layers.py"]


def package_imports():
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specdecode") \
                    and node.level == 0:
                yield path.relative_to(ROOT), node.lineno, node.module, [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("specdecode"):
                        yield path.relative_to(ROOT), node.lineno, alias.name, []


def test_every_import_of_the_package_resolves():
    missing = []
    seen = 0
    for where, line, module, names in package_imports():
        seen += 1
        try:
            imported = importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{where}:{line}: {module} ({exc})")
            continue
        for name in names:
            if not hasattr(imported, name):
                try:
                    importlib.import_module(f"{module}.{name}")
                except ImportError:
                    missing.append(f"{where}:{line}: {module} has no {name}")
    assert seen > 300
    assert not missing, "\n".join(missing)
