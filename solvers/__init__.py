"""Torch-free planning: the Profile and Schedule types, the simulator, and the solvers.

Nothing in this package imports torch, so a profile recorded on a GPU box can be planned anywhere.
"""

from solvers.errors import CkptPlannerError, ProfileError, ScheduleError, SolverUnavailableError
from solvers.profile import Node, Profile, ProfileMeta
from solvers.schedule import Region, Schedule
from solvers.simulate import simulate
from solvers.solve import available_methods, solve

__all__ = [
    "CkptPlannerError",
    "Node",
    "Profile",
    "ProfileError",
    "ProfileMeta",
    "Region",
    "Schedule",
    "ScheduleError",
    "SolverUnavailableError",
    "available_methods",
    "simulate",
    "solve",
]
