"""The `>>>` examples in the docstrings of every public name (`workbench.__all__`) run and print
what they show, through the standard library's doctest (found on the objects, so a class's
methods are included)."""

from __future__ import annotations

import doctest

import pytest

import workbench as wb

FINDER = doctest.DocTestFinder(exclude_empty=True)
FLAGS = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS


def _examples() -> list[doctest.DocTest]:
    found, seen = [], set()
    for name in wb.__all__:
        for test in FINDER.find(getattr(wb, name), f"wb.{name}"):
            if test.examples and test.name not in seen:
                seen.add(test.name)
                found.append(test)
    return found


EXAMPLES = _examples()


def test_the_public_names_have_examples():
    assert len(EXAMPLES) >= 10, [t.name for t in EXAMPLES]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda t: t.name)
def test_docstring_example(example, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an example that writes a file writes it here
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    failures = []
    runner.run(example, out=failures.append)
    assert runner.failures == 0, "".join(failures)
