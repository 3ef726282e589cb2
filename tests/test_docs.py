"""The manual keeps up with the code: every setting is documented, and the README stays short."""

from __future__ import annotations

from pathlib import Path

from app.settings import Settings

ROOT = Path(__file__).parents[1]


def test_every_setting_is_in_the_operations_page() -> None:
    page = (ROOT / "docs" / "operations.md").read_text()
    for name in Settings.model_fields:
        assert f"`QGEMM_{name.upper()}`" in page and f"`--{name.replace('_', '-')}`" in page, name


def test_the_readme_is_under_200_lines_and_links_the_manual() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    for page in ("install", "models", "api", "kernels", "formats", "accuracy", "serving", "operations", "performance"):
        assert f"docs/{page}.md" in readme and (ROOT / "docs" / f"{page}.md").is_file(), page
