"""Torch-free planning: the Profile and Schedule types, the simulator, and the solvers.

Nothing in this package imports torch, so a profile recorded on a GPU box can be planned anywhere.
"""

from solvers.errors import CkptPlannerError, ProfileError, ScheduleError, SolverUnavailableError
from solvers.profile import Node, Profile, ProfileMeta

__all__ = [
    "CkptPlannerError",
    "Node",
    "Profile",
    "ProfileError",
    "ProfileMeta",
    "ScheduleError",
    "SolverUnavailableError",
]
