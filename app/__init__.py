"""qgemm's FastAPI service."""

__version__ = "0.1.0"
