"""The README's layout section names every module of the package, and nothing that is gone."""

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def layout_section() -> str:
    text = open(os.path.join(REPO, "README.md")).read()
    start = text.index("## Layout of the repository")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def modules() -> set[str]:
    """kvtier's modules as ``package/dir/name.py`` paths (package markers left out)."""
    out = set()
    for root, dirs, files in os.walk(os.path.join(REPO, "kvtier")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            if f.endswith(".py") and f not in ("__init__.py", "__main__.py"):
                out.add(os.path.relpath(os.path.join(root, f), REPO))
    return out


def test_every_module_is_named_in_its_packages_row():
    """Each row is one package (`kvtier/<pkg>`); a module counts as named when its
    file name appears in its own package's row (or, for top-level modules, anywhere)."""
    section = layout_section()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(kvtier/[^`]*)` \|.*$", section, re.M)}
    missing = []
    for path in sorted(modules()):
        pkg, name = os.path.dirname(path), os.path.basename(path)
        row = next((rows[p] for p in sorted(rows, key=len, reverse=True)
                    if pkg == p or pkg.startswith(p + "/")), section)
        if name not in row:
            missing.append(path)
    assert not missing, f"README's layout section does not name: {missing}"


def test_every_module_the_layout_names_exists():
    section = layout_section()
    named = set(re.findall(r"`([a-z_]+\.py)`", section))
    existing = {os.path.basename(p) for p in modules()} | {
        f for d in ("scripts", "client") for f in os.listdir(os.path.join(REPO, d)) if f.endswith(".py")}
    assert named <= existing, f"named in README but gone: {sorted(named - existing)}"


def test_every_design_note_in_docs_has_its_row():
    """Each ``docs/*.md`` is a row of its own (`docs/NAME.md` in the first column)."""
    section = layout_section()
    rows = set(re.findall(r"^\| `(docs/[^`]+\.md)` \|", section, re.M))
    notes = {f"docs/{f}" for f in os.listdir(os.path.join(REPO, "docs")) if f.endswith(".md")}
    assert notes <= rows, f"README's layout section has no row for: {sorted(notes - rows)}"
    assert rows <= notes, f"README's layout section names notes that are gone: {sorted(rows - notes)}"
