"""Torch-free planning: the Profile and Schedule types, the simulator, and the solvers.

Nothing in this package imports torch, so a profile recorded on a GPU box can be planned anywhere:

    >>> from solvers import Profile, solve, parse_budget
    >>> profile = Profile.load("profiles/gpt2_small_h100.json.gz")       # doctest: +SKIP
    >>> schedule = solve(profile, parse_budget("6GiB"), method="dp")     # doctest: +SKIP
    >>> schedule.status, schedule.predicted_recompute_ms                 # doctest: +SKIP

The layout is the pipeline: `profile` (the recorded step) and `graph` (its integer view);
`chain` (where regions over the forward chain may go, and what replaying them runs); `simulate`
(the one check every answer passes); the methods `baselines`, `dp` and `ilp`; and `solve`, which
lists them by name and validates what they return.
"""

from solvers.errors import CkptPlannerError, ProfileError, ScheduleError, SolverUnavailableError
from solvers.profile import ModuleCall, Node, Profile, ProfileMeta
from solvers.schedule import Method, Region, Schedule
from solvers.simulate import Simulation, simulate
from solvers.solve import BASELINES, available_methods, smallest_peak, solve
from solvers.units import BudgetError, format_bytes, parse_budget

__all__ = [
    "BASELINES",
    "BudgetError",
    "CkptPlannerError",
    "Method",
    "ModuleCall",
    "Node",
    "Profile",
    "ProfileError",
    "ProfileMeta",
    "Region",
    "Schedule",
    "ScheduleError",
    "Simulation",
    "SolverUnavailableError",
    "available_methods",
    "format_bytes",
    "parse_budget",
    "simulate",
    "smallest_peak",
    "solve",
]
