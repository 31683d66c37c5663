"""The order in which ``make test`` hands the test files to its workers."""

from __future__ import annotations

from pathlib import Path


def test_the_files_collected_first_exist_and_make_test_keeps_their_order():
    """``tests/conftest.py``'s ``SLOWEST_FILES`` are collected first so that ``make test``'s workers start on them;
    a renamed file would silently fall back to pytest's order, and without ``--no-loadscope-reorder`` xdist would
    order the files by their number of tests instead."""
    from tests.conftest import SLOWEST_FILES

    tests = Path(__file__).parent
    assert [name for name in SLOWEST_FILES if not (tests / name).is_file()] == []
    assert len(set(SLOWEST_FILES)) == len(SLOWEST_FILES)
    make_test = (tests.parent / "Makefile").read_text().split("\ntest:")[1].split("\n\n")[0]
    assert "--dist loadfile --no-loadscope-reorder" in make_test
