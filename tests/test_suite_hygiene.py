"""The suite's own rules, read from its source (issue 60, item 5): no test function passes
without checking anything.

A test checks something when its body (nested functions included) has an ``assert``, a
``raise``, a ``pytest.raises``/``warns``/``fail``/``skip``/``xfail``/``deprecated_call``,
calls an assertion by name (``np.testing.assert_allclose``, ``self.assertEqual``: any call
whose name starts with ``assert``), or calls a function defined in tests/ that checks: one
named ``check_*``/``expect_*``, or one whose own body checks by this same rule (followed
through the module's own functions and what it imports from tests/ modules, any depth).
Pure AST: nothing is imported, so this runs without TensorFlow.
"""

import ast
import pathlib

import pytest

TESTS = pathlib.Path(__file__).resolve().parent
PYTEST_CHECKS = {"raises", "warns", "fail", "skip", "xfail", "deprecated_call"}
HELPER_PREFIXES = ("assert", "check_", "expect_")


class Suite:
    """The tests/ modules by name: their module-level functions and what each imports from
    the others; answers whether a function checks something."""

    def __init__(self, sources):
        self.functions = {}  # module -> {name: FunctionDef}
        self.imports = {}    # module -> {local name: (module, name or None for the module)}
        self._trees = {}
        for module, source in sources.items():
            tree = ast.parse(source)
            self.functions[module] = {node.name: node for node in tree.body
                                      if isinstance(node, (ast.FunctionDef,
                                                           ast.AsyncFunctionDef))}
            self.imports[module] = {}
            self._trees[module] = tree
        for module, tree in self._trees.items():
            for node in tree.body:
                if isinstance(node, ast.ImportFrom) and node.module in sources and not node.level:
                    for alias in node.names:
                        self.imports[module][alias.asname or alias.name] = (node.module,
                                                                            alias.name)
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        if alias.name in sources:
                            self.imports[module][alias.asname or alias.name] = (alias.name, None)
        self._checks = {}

    def _resolve(self, module, call):
        """The tests/ function a call names, as (module, name), or None."""
        func = call.func
        if isinstance(func, ast.Name):
            if func.id in self.functions[module]:
                return module, func.id
            target = self.imports[module].get(func.id)
            if target and target[1] is not None and target[1] in self.functions[target[0]]:
                return target
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            target = self.imports[module].get(func.value.id)
            if target and target[1] is None and func.attr in self.functions[target[0]]:
                return target[0], func.attr
        return None

    def checks(self, module, node):
        """Whether the function ``node`` of ``module`` checks something (rule above)."""
        for sub in (n for stmt in node.body for n in ast.walk(stmt)):
            if isinstance(sub, (ast.Assert, ast.Raise)):
                return True
            if not isinstance(sub, ast.Call):
                continue
            func = sub.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
                    and func.value.id == "pytest" and name in PYTEST_CHECKS):
                return True
            if name.startswith("assert"):
                return True
            target = self._resolve(module, sub)
            if target is None:
                continue
            if target[1].startswith(HELPER_PREFIXES) or self._helper_checks(target):
                return True
        return False

    def _helper_checks(self, target):
        if target not in self._checks:
            self._checks[target] = False  # a recursion (a helper calling itself) checks nothing
            self._checks[target] = self.checks(target[0], self.functions[target[0]][target[1]])
        return self._checks[target]

    def unchecked_tests(self, module):
        """``module:line name`` for every test function of a test module that checks nothing."""
        found = []
        for node in self._trees[module].body:
            candidates = [node]
            if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                candidates = node.body
            for fn in candidates:
                if (isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                        and fn.name.startswith("test") and not self.checks(module, fn)):
                    found.append(f"{module}.py:{fn.lineno} {fn.name}")
        return found


def suite_sources():
    return {path.stem: path.read_text() for path in sorted(TESTS.glob("*.py"))}


def test_every_test_function_checks_something():
    sources = suite_sources()
    suite = Suite(sources)
    unchecked = [name for module in sources if module.startswith("test_")
                 for name in suite.unchecked_tests(module)]
    assert unchecked == [], (
        "test functions that assert nothing (give each a check that can fail):\n  "
        + "\n  ".join(unchecked))


def test_the_scan_sees_every_test_module():
    sources = suite_sources()
    assert len([m for m in sources if m.startswith("test_")]) > 50
    assert "test_suite_hygiene" in sources and "helpers" in sources


# --- guards: the rule on small sources --------------------------------------------------------

HELPERS_SOURCE = '''
def compare(a, b):
    assert a == b

def indirect(a, b):
    return compare(a, b)

def train(model):
    return model.fit()
'''


@pytest.mark.parametrize("body, checks", [
    ("x = 1\n    x += 1", False),
    ("train(object())", False),                      # a helper that checks nothing
    ("helpers.train(object())", False),
    ("assert 1 + 1 == 2", True),
    ("with pytest.raises(ValueError):\n        int('x')", True),
    ("pytest.skip('no GPU')", True),
    ("np.testing.assert_allclose(1.0, 1.0)", True),
    ("compare(1, 1)", True),                         # imported from a tests/ module
    ("helpers.indirect(1, 1)", True),                # through the module, two levels down
    ("local_check(1)", True),                        # a function of the same module
    ("check_output(1)", True),                       # by its name: tests/ helper check_*
    ("def inner():\n        assert True\n    inner()", True),
    ("if 1 > 2:\n        raise AssertionError('no')", True),
])
def test_guard_the_scan_finds_an_assertion_free_test(body, checks):
    source = ("import helpers\nfrom helpers import compare, train\n\n"
              "def local_check(x):\n    assert x\n\n"
              "def check_output(x):\n    return x\n\n"
              f"def test_case():\n    {body}\n")
    suite = Suite({"test_sample": source, "helpers": HELPERS_SOURCE})
    unchecked = suite.unchecked_tests("test_sample")
    assert unchecked == ([] if checks else ["test_sample.py:10 test_case"])


def test_guard_methods_of_test_classes_are_scanned():
    source = "class TestThing:\n    def test_nothing(self):\n        pass\n\n" \
             "    def test_something(self):\n        self.assertEqual(1, 1)\n"
    assert Suite({"test_sample": source}).unchecked_tests("test_sample") == [
        "test_sample.py:2 test_nothing"]
