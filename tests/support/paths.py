"""Where the repository is, for tests at any depth under ``tests/``."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
