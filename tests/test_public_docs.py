"""Every public name of the user-facing modules is documented in the README (by name: its table
of the API or a section), so a new export cannot land undocumented."""

import importlib
import inspect
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
EXPORTING = ["cutelayers", "cutelayers.ops", "cutelayers.aot"]
MODULES = ["cutelayers.flax.linen", "cutelayers.flax.nnx", "cutelayers.equinox"]


def public_names(module_name: str) -> list[str]:
    """``__all__``, or else the classes and functions the module defines without a leading underscore."""
    module = importlib.import_module(module_name)
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [name for name, obj in vars(module).items()
            if not name.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj))
            and obj.__module__ == module_name]


@pytest.mark.parametrize("module_name", EXPORTING + MODULES)
def test_every_public_name_is_in_the_readme(module_name):
    names = public_names(module_name)
    assert names, f"{module_name} exports nothing"
    missing = [name for name in names if name not in README]
    assert not missing, f"{module_name}: public names the README does not mention: {missing}"
