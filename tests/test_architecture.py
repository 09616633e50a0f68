"""The import rules of docs/architecture.md, read from the source (nothing is imported)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_only_jax_compat_touches_jax_internals():
    users = sorted(str(path.relative_to(ROOT)) for folder in ("cutelayers", "models", "training")
                   for path in (ROOT / folder).rglob("*.py") if "jax._src" in path.read_text())
    assert users == ["cutelayers/runtime/_jax_compat.py"]
