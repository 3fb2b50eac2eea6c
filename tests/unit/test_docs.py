"""The documentation follows the code: docs/architecture.md's module map is generated from the
module docstrings, every module has one, and the paths, modules and links that README.md and
docs/ name exist."""

import re

from support.configs import ROOT

from engine import architecture

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


PATH = re.compile(r"(?<![\w/.~-])((?:engine|models|contract|tests|benchmarks|configs)/[\w/.-]*\w)")


MODULE = re.compile(r"`((?:engine|models|contract)(?:\.\w+)+)")


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")


def test_the_module_map_is_generated_from_the_module_docstrings():
    text = architecture.DOC.read_text()
    stale = "docs/architecture.md's module map is stale: python -m engine.architecture"
    assert architecture.rewrite(text) == text, stale
    assert architecture.main(["--check"]) == 0
    assert "| [`loop.py`](../engine/run/loop.py) | The training loop, once. |" in text
    assert "### `engine/run/`" in text and "### `models/`" in text and "### `contract/`" in text


def test_every_module_says_what_it_holds():
    assert architecture.missing() == [], "a module docstring's first sentence is its line in docs/architecture.md"


def test_the_first_sentence_is_the_summary():
    first = architecture.first_sentence
    assert first("The loop, once. More.") == "The loop, once."
    command = "`launch.py ... --x`: a command (e.g. this one)."
    assert first(command + "\nMore.") == command
    assert first("Two\nlines, e.g. these. Next.") == "Two lines, e.g. these."
    assert first("What it adds:\n\n- one\n- two") == "What it adds."
    assert first("No full stop") == "No full stop"


def test_the_docs_name_only_paths_and_modules_that_exist():
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for path in PATH.findall(text):
            path = path.rstrip(".")
            if "*" not in path and "<" not in path and not (ROOT / path).exists():
                missing.append(f"{doc.name}: {path}")
        for dotted in MODULE.findall(text):
            parts = dotted.split(".")
            if not any(_is_module(parts[:n]) for n in range(len(parts), 1, -1)):
                missing.append(f"{doc.name}: {dotted}")
        for link in LINK.findall(text):
            if "://" not in link and not (doc.parent / link).exists():
                missing.append(f"{doc.name}: link {link}")
    assert not missing, missing


def _is_module(parts: list[str]) -> bool:
    path = ROOT.joinpath(*parts)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()
