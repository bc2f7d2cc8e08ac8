"""Where the repository's own folders are, for tests at any depth under ``tests/``."""

from __future__ import annotations

from pathlib import Path

#: The repository's root (the folder holding ``aiorl/``, ``docs/``, ``tests/``).
REPO_ROOT = Path(__file__).resolve().parent.parent
