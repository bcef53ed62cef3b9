"""Schedules, one class each, chosen by name from the job's [schedule] table (nebula.runtime.schedules.base
has the contract; docs/runtime.md, "Schedules", the table)."""
from nebula.runtime.schedules.base import ExactWeights, Schedule, build_schedule, register_schedule, schedule_names
from nebula.runtime.schedules.forward_only import ForwardOnly
from nebula.runtime.schedules.gpipe import GPipe
from nebula.runtime.schedules.one_f_one_b import OneFOneB
from nebula.runtime.schedules.one_step_stale import OneStepStale, WeightStash
from nebula.runtime.schedules.pace import Pace
from nebula.runtime.schedules.synchronous import Synchronous

__all__ = ["ExactWeights", "ForwardOnly", "GPipe", "OneFOneB", "OneStepStale", "Pace", "Schedule", "Synchronous",
           "WeightStash", "build_schedule", "register_schedule", "schedule_names"]
