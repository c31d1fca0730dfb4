"""The tier table (tests/tiers.py) covers every test file, names only tests that exist, and uses only the tiers
pyproject.toml registers; the collection hook marks every test with one tier and refuses a file it does not
know."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.tiers import FILE_TIERS, TEST_TIERS, TIERS, MissingTier, tier_of

TESTS = Path(__file__).resolve().parent


def test_every_test_file_has_a_tier():
    files = {p.name for p in TESTS.glob("test_*.py")}
    assert not files - set(FILE_TIERS), f"test files without a tier: {sorted(files - set(FILE_TIERS))}"
    assert not set(FILE_TIERS) - files, f"tiers for files that are gone: {sorted(set(FILE_TIERS) - files)}"
    assert set(FILE_TIERS.values()) | set(TEST_TIERS.values()) <= set(TIERS)


def test_every_exception_names_a_test_that_exists():
    for key in TEST_TIERS:
        file_name, function = key.split("::")
        tree = ast.parse((TESTS / file_name).read_text())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        assert function in names, f"{key}: no such test"
        assert TEST_TIERS[key] != FILE_TIERS[file_name], f"{key}: the same tier as its file, drop the line"


def test_the_tiers_are_the_registered_markers(pytestconfig):
    registered = {line.split(":")[0].strip() for line in pytestconfig.getini("markers")}
    assert set(TIERS) <= registered


def test_a_file_without_a_tier_is_an_error():
    with pytest.raises(MissingTier, match="tests/test_new.py has no tier: add it to FILE_TIERS"):
        tier_of("test_new.py", "test_something")
    assert tier_of("test_pd_disagg.py", "test_e_p_d_roles_share_the_cores_on_one_machine") == "unit"
    assert tier_of("test_pd_disagg.py", "test_e_p_d_matches_aggregated") == "transport"


class FakeItem:
    """What the collection hook reads of a pytest item."""

    def __init__(self, file_name: str, function: str, *markers: str):
        self.path, self.originalname, self.name = TESTS / file_name, function, function
        self.nodeid = f"tests/{file_name}::{function}"
        self.markers = [getattr(pytest.mark, m).mark for m in markers]

    def add_marker(self, name: str) -> None:
        self.markers.append(getattr(pytest.mark, name).mark)

    def iter_markers(self):
        return iter(self.markers)


def test_collection_marks_each_test_with_its_tier_and_stops_at_a_file_without_one():
    from tests.conftest import pytest_collection_modifyitems

    items = [FakeItem("test_sampler.py", "test_a"),
             FakeItem("test_pd_disagg.py", "test_e_p_d_roles_share_the_cores_on_one_machine"),
             FakeItem("test_pd_disagg.py", "test_e_p_d_matches_aggregated"), FakeItem("test_sampler.py", "test_b")]
    pytest_collection_modifyitems(None, items)
    # The files of the costliest tiers first (a file counts as its costliest test), each file's tests in their order.
    assert [(i.path.name, i.name, [m.name for m in i.markers]) for i in items] == [
        ("test_pd_disagg.py", "test_e_p_d_roles_share_the_cores_on_one_machine", ["unit"]),
        ("test_pd_disagg.py", "test_e_p_d_matches_aggregated", ["transport"]),
        ("test_sampler.py", "test_a", ["unit"]), ("test_sampler.py", "test_b", ["unit"])]
    with pytest.raises(pytest.UsageError, match="tests/test_new.py has no tier"):
        pytest_collection_modifyitems(None, [FakeItem("test_new.py", "test_x")])
    with pytest.raises(pytest.UsageError, match="one tier per test"):  # a file's own marker disagreeing
        pytest_collection_modifyitems(None, [FakeItem("test_sampler.py", "test_a", "engine")])
