"""The errors a user can fix, at the floor of the trainer's imports: every module may raise them, none is imported.

`RecipeError`: a recipe (or its run) that cannot be used, with the fix; `DataError`: data the run cannot train on,
naming the file, row and field. The entry points print either without a traceback (exit 2).
"""

from __future__ import annotations


class RecipeError(ValueError):
    """A recipe that cannot be used, with a message that says how to fix it."""


class DataError(RecipeError):
    """Data the run cannot train on, with the file, row and field it is about and how to fix it."""
