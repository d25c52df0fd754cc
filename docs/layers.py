"""Draw specdecode's layers and the imports between its packages: docs/architecture.png.

    python docs/layers.py            # reads the layers from pyproject.toml, the imports with grimp (import-linter's)

Each row is a layer of the import contract (top imports bottom, never the reverse); an arrow A -> B is labelled
with the number of import statements in A that name B (those inside functions too).
"""
from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import grimp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def layers() -> list[list[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    return [[name.strip() for name in layer.split("|")] for layer in config["layers"]]


def package_edges(graph, packages: list[str]) -> dict[tuple[str, str], int]:
    """(importer package, imported package) -> import statements, between the given packages."""
    def owner(module: str) -> str | None:
        return next((p for p in packages if module == p or module.startswith(p + ".")), None)

    edges: dict[tuple[str, str], int] = {}
    for module in graph.modules:
        source = owner(module)
        if source is None:
            continue
        for imported in graph.find_modules_directly_imported_by(module):
            target = owner(imported)
            if target is not None and target != source:
                details = graph.get_import_details(importer=module, imported=imported)
                edges[source, target] = edges.get(source, 0) + max(1, len(details))
    return edges


def draw(out: Path) -> None:
    rows = layers()
    packages = [p for row in rows for p in row]
    graph = grimp.build_graph("specdecode")
    edges = package_edges(graph, packages)
    width, height = 12.0, 1.1 * len(rows) + 0.6
    fig, ax = plt.subplots(figsize=(width, height))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    centre = {}
    for r, row in enumerate(rows):
        y = height - 0.8 - 1.1 * r
        slot = width / len(row)
        for i, name in enumerate(row):
            x = slot * (i + 0.5)
            lines = sum(len(p.read_text().splitlines()) for p in _files(name))
            label = f"{name.removeprefix('specdecode.')}\n{lines:,} lines"
            ax.add_patch(FancyBboxPatch((x - 1.3, y - 0.32), 2.6, 0.64, boxstyle="round,pad=0.02",
                                        facecolor="#dce8f5", edgecolor="#35577d"))
            ax.text(x, y, label, ha="center", va="center", fontsize=9)
            centre[name] = (x, y)
    for (source, target), count in sorted(edges.items()):
        (x0, y0), (x1, y1) = centre[source], centre[target]
        up = y1 > y0
        ax.add_patch(FancyArrowPatch((x0, y0 - 0.32 if not up else y0 + 0.32), (x1, y1 + 0.32 if not up else y1 - 0.32),
                                     arrowstyle="-|>", mutation_scale=9, lw=0.6 + 0.15 * min(count, 20),
                                     color="#c0392b" if up else "#7f8c8d", alpha=0.7,
                                     connectionstyle="arc3,rad=0.08"))
    upward = sum(1 for (s, t) in edges if centre[t][1] > centre[s][1])
    ax.set_title(f"specdecode: {len(packages)} packages in {len(rows)} layers, {len(edges)} package-to-package "
                 f"import arrows, {upward} pointing up", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out} ({len(edges)} arrows, {upward} up)")


def _files(package: str) -> list[Path]:
    path = ROOT / Path(*package.split("."))
    return sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]


if __name__ == "__main__":
    draw(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "architecture.png")
