"""A sidejax experiment as a Flower app (see ../pyproject.toml and docs/deploying.md)."""
