"""Buffer hazards and ``after=`` edges: the core's ``aiogpu._core.hazards``, under the name
importers have used (the same objects, so ``ordering.HostRange is hazards.HostRange``)."""
from ._core.hazards import (HostRange, Hazards, broken_error, dependencies, failed_dependency,
                            failed_without_running, prune, record, state_of, touching)

__all__ = ["HostRange", "Hazards", "broken_error", "dependencies", "failed_dependency",
           "failed_without_running", "prune", "record", "state_of", "touching"]
