"""Exceptions named for what went wrong, shared by `solvers` and `planner`."""

from __future__ import annotations

__all__ = [
    "CkptPlannerError",
    "ProfileError",
    "ScheduleError",
    "SolverUnavailableError",
]


class CkptPlannerError(Exception):
    """Base class of every error this project raises on purpose."""


class ProfileError(CkptPlannerError, ValueError):
    """A profile is malformed: a missing field, an unknown version, a cycle, a dangling input."""


class ScheduleError(CkptPlannerError, ValueError):
    """A schedule does not fit the profile it is applied to."""


class SolverUnavailableError(CkptPlannerError, RuntimeError):
    """A solver method needs a package that is not installed."""
