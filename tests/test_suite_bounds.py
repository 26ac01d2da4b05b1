"""The suite kept in bounds by its own recorded run (``benchmarks/test_durations.json``, written by
``benchmarks/suite_durations.py``): a test that took over 30 s says why in its docstring, and the recorded
run names the machine and commit it was measured on."""

from tests.helpers.durations import DURATIONS, SLOW_S, recorded, unexplained_slow_tests


def test_every_test_over_30_s_says_why():
    run = recorded()
    assert run is not None, f"{DURATIONS} is missing: python benchmarks/suite_durations.py <junit xml> writes it"
    slow = [t for t, s in run["tests"].items() if s > SLOW_S]
    assert slow, "the recorded run has no test over 30 s: then this check checks nothing"
    assert not (bad := unexplained_slow_tests(run["tests"])), (
        "these tests took over 30 s in the recorded run and their docstrings do not say why "
        f"(\"Over 30 s: ...\"): {bad}")


def test_a_slow_test_without_a_reason_is_named(tmp_path):
    """The control: of the tests recorded over 30 s, those whose docstrings lack the reason are named (a
    class's method too); a case of the same test under 30 s, one at 30 s and one no longer in its file are
    not judged."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        'def test_silent():\n    """Trains a draft."""\n\n\n'
        'def test_says():\n    """Trains a draft. Over 30 s: 400 steps."""\n\n\n'
        'def test_bare():\n    pass\n\n\n'
        'class TestGroup:\n    def test_method(self):\n        """No reason."""\n')
    tests = {"tests/test_x.py::test_silent[a]": 31.0, "tests/test_x.py::test_silent[b]": 5.0,
             "tests/test_x.py::test_says": 90.0, "tests/test_x.py::test_bare": 30.0,
             "tests/test_x.py::test_gone": 99.0, "tests/test_x.py::TestGroup::test_method": 45.0}
    assert unexplained_slow_tests(tests, tmp_path) == ["tests/test_x.py::test_silent[a]",
                                                       "tests/test_x.py::TestGroup::test_method"]


def test_the_recorded_run_names_its_machine():
    run = recorded()
    for key in ("date", "commit", "cpu", "cores", "torch", "how"):
        assert run["info"].get(key), key
    assert recorded(DURATIONS.parent / "no-such-file.json") is None
