"""The project's error base: each error's class says its exit code and whether another attempt could help.

    Classified   the mixin of the project's errors (ConfigError, DataError, ...)
    exit_code(e) a command's exit code for ``e`` (launch/cli.py's one error path)
    retried(e)   whether another attempt could get past ``e`` (the error record's ``retry``; pipeline/stops.py
                 decides what comes next from it)

Standard library only, on the ground floor: every layer and data_prep raise these.
"""

from __future__ import annotations


class Classified:
    """Mixin of the project's errors. ``exit_code``: 1 a run that started and failed, 2 a mistake in
    what was asked (None: a base class decides). ``retry``: False when another attempt would raise it
    again (a bad config, a missing dataset, a non-finite loss), so no cluster.max_failures is spent."""

    exit_code: int | None = None
    retry: bool | None = None


# builtins the project raises for its own mistakes (ConfigError, DataError, ... are ValueErrors)
_BUILTIN = {ValueError: (2, None), FileNotFoundError: (2, False), ImportError: (None, False)}


def _first(e: BaseException, i: int, attr: str):
    for c in type(e).__mro__:  # the most specific class that says
        value = vars(c).get(attr) if issubclass(c, Classified) else None
        if value is None:
            value = _BUILTIN.get(c, (None, None))[i]
        if value is not None:
            return value
    return None


def exit_code(e: BaseException) -> int | None:
    """A command's exit code for the project error ``e``; None for anything else (a bug: its traceback)."""
    return _first(e, 0, "exit_code")


def retried(e: BaseException) -> bool:
    """Whether another attempt could get past ``e`` (anything not known to be deterministic)."""
    return _first(e, 1, "retry") is not False
