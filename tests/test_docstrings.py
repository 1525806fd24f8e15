"""Every public function and method of nanfast's API documents its arguments, what it returns and what
it raises (issue 17): a docstring with Args / Returns / Raises sections where they apply."""

import dataclasses
import inspect
import re

import pytest

import nanfast


def _public_callables():
    """(qualified name, function, owning class or None) for nanfast.__all__ and the public methods of
    its classes (inherited ones from nanfast's own bases included)."""
    found = {}
    for name in nanfast.__all__:
        obj = getattr(nanfast, name)
        if inspect.isclass(obj):
            for klass in obj.__mro__:
                if not klass.__module__.startswith("nanfast"):
                    continue
                for attr, value in vars(klass).items():
                    if (attr == "__init__" or not attr.startswith("_")) and inspect.isfunction(value):
                        found.setdefault(f"{name}.{attr}", (value, obj))
        elif callable(obj):
            found[name] = (obj, None)
    return sorted(found.items())


def _missing_sections(fn, owner) -> list[str]:
    if fn.__name__ == "__init__":
        if dataclasses.is_dataclass(owner):
            return []  # the generated __init__: the fields are documented on the class
        doc = inspect.getdoc(owner) or ""
    else:
        doc = inspect.getdoc(fn) or ""
    sig = inspect.signature(fn)
    missing = []
    if [p for p in sig.parameters if p not in ("self", "cls")] and "Args:" not in doc:
        missing.append("Args")
    if fn.__name__ != "__init__" and sig.return_annotation not in (None, "None", inspect.Signature.empty) \
            and "Returns:" not in doc:
        missing.append("Returns")
    body = inspect.getsource(fn).split('"""')[-1]
    if re.search(r"^\s*raise \w", body, re.M) and "Raises:" not in doc:
        missing.append("Raises")
    return missing


PUBLIC = _public_callables()


def test_the_walk_finds_the_api():
    names = {name for name, _ in PUBLIC}
    assert {"stats", "check_all", "watch", "locate", "Watch.loss", "Watch.stats", "Report.summary"} <= names


@pytest.mark.parametrize("name,fn_owner", PUBLIC, ids=[name for name, _ in PUBLIC])
def test_public_docstring_has_its_sections(name, fn_owner):
    fn, owner = fn_owner
    missing = _missing_sections(fn, owner)
    assert not missing, f"{name}: the docstring lacks {', '.join(missing)}"
