"""A kit for testing actor protocols: hypothesis state machines, virtual time, injected faults.

``from asyncflow_actors import testing as aft`` (``docs/testing.md``). What it holds:

- driving trio from hypothesis: ``TrioStateMachine``/``ActorMachine`` (a trio loop per example
  in a helper thread; ``@in_trio`` async rules), ``TrioThread``, ``protocol_settings``;
- schedules and determinism: ``replay`` (a generated schedule in one ``trio.run``),
  ``run_deterministic`` (seeded scheduler, ``MockClock``), ``TaskTrace``; ``settle``,
  ``advance``, ``attempt`` (returned, raised, or blocked forever); ``find_exception`` (the
  assertion inside an exception group);
- faults: ``faulty(ActorClass)`` + ``FaultPlan`` (``CrashAt``, ``CrashOnStart``, ``StallAt``,
  ``KillProcessAt``), the same for local actors and actors on nodes; ``open_link_proxy``
  (drop, delay, duplicate, partition on a link between systems, at the transport level) with
  ``route_through``/``RouteLinks`` for the links the runtime opens by itself;
  ``open_node_process``, ``kill_node``, ``frozen_process``;
- reusable models: ``SupervisionModel``/``SupervisionMachine``, ``TransferQueueLedger``,
  ``FlowControlModel``/``check_flow_control_schedule``;
- leak checks: ``ResourceSnapshot``, ``check_no_leaks``, ``no_leaks``;
- whole runs under random faults (the soak): ``FaultSchedule`` (a seeded plan),
  ``open_fault_campaign`` (carried out against a pipeline run), ``open_link_faults``,
  ``roles_at``/``target_node`` (what a fault's process holds, folded stations included),
  ``run_soak`` (a run under a campaign, judged from its ledger: ``SoakResult``).

The parts built on hypothesis (state machines, strategies, models), on the TransferQueue and on
the pipeline load on first use, so a node process that imports a module defining a ``faulty`` actor needs neither.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._faults import CrashAt as CrashAt
from ._faults import CrashOnStart as CrashOnStart
from ._faults import Fault as Fault
from ._faults import FaultCounters as FaultCounters
from ._faults import FaultPlan as FaultPlan
from ._faults import FaultPlanError as FaultPlanError
from ._faults import InjectedCrash as InjectedCrash
from ._faults import KillProcessAt as KillProcessAt
from ._faults import StallAt as StallAt
from ._faults import fault_counters as fault_counters
from ._faults import faulty as faulty
from ._faults import forget_fault_counters as forget_fault_counters
from ._harness import CallTimeout as CallTimeout
from ._harness import HarnessError as HarnessError
from ._harness import TrioThread as TrioThread
from ._leaks import ResourceLeak as ResourceLeak
from ._leaks import ResourceSnapshot as ResourceSnapshot
from ._leaks import check_no_leaks as check_no_leaks
from ._leaks import no_leaks as no_leaks
from ._leaks import warm_up_zmq as warm_up_zmq
from ._processes import NodeProcess as NodeProcess
from ._processes import alive as alive
from ._processes import frozen_process as frozen_process
from ._processes import kill9 as kill9
from ._processes import kill_node as kill_node
from ._processes import open_node_process as open_node_process
from ._processes import wait_node_restarted as wait_node_restarted
from ._processes import wait_until as wait_until
from ._proxy import Direction as Direction
from ._proxy import LinkMessage as LinkMessage
from ._proxy import LinkProxy as LinkProxy
from ._proxy import LinkProxyStatistics as LinkProxyStatistics
from ._proxy import LinkRule as LinkRule
from ._proxy import open_link_proxy as open_link_proxy
from ._replay import TaskTrace as TaskTrace
from ._replay import TraceStep as TraceStep
from ._replay import find_exception as find_exception
from ._replay import replay as replay
from ._replay import run_deterministic as run_deterministic
from ._replay import seed_scheduler as seed_scheduler
from ._routes import RouteLinks as RouteLinks
from ._routes import Routes as Routes
from ._routes import route_through as route_through
from ._time import Attempt as Attempt
from ._time import Blocked as Blocked
from ._time import Raised as Raised
from ._time import Returned as Returned
from ._time import advance as advance
from ._time import attempt as attempt
from ._time import settle as settle

if TYPE_CHECKING:
    from ._flow import FlowControlLike as FlowControlLike
    from ._flow import FlowControlModel as FlowControlModel
    from ._flow import check_flow_control_schedule as check_flow_control_schedule
    from ._flow import flow_control_ops as flow_control_ops
    from ._machine import ActorMachine as ActorMachine
    from ._machine import TrioStateMachine as TrioStateMachine
    from ._machine import in_trio as in_trio
    from ._machine import protocol_settings as protocol_settings
    from ._soak import FAULT_KINDS as FAULT_KINDS
    from ._soak import FaultCampaign as FaultCampaign
    from ._soak import FaultKind as FaultKind
    from ._soak import FaultSchedule as FaultSchedule
    from ._soak import InjectedFault as InjectedFault
    from ._soak import PlannedFault as PlannedFault
    from ._soak import fault_targets as fault_targets
    from ._soak import node_base_name as node_base_name
    from ._soak import open_fault_campaign as open_fault_campaign
    from ._soak import open_link_faults as open_link_faults
    from ._soak import roles_at as roles_at
    from ._soak import target_node as target_node
    from ._soak_run import LedgerMissing as LedgerMissing
    from ._soak_run import SoakResult as SoakResult
    from ._soak_run import require_ledger as require_ledger
    from ._soak_run import run_soak as run_soak
    from ._supervision import ModelNode as ModelNode
    from ._supervision import SupervisionModel as SupervisionModel
    from ._supervision import supervision_trees as supervision_trees
    from ._supervision import supervisor_strategies as supervisor_strategies
    from ._supervision_machine import LifecycleLog as LifecycleLog
    from ._supervision_machine import LoggingSupervisor as LoggingSupervisor
    from ._supervision_machine import LoggingWorker as LoggingWorker
    from ._supervision_machine import SupervisionMachine as SupervisionMachine
    from ._tq import TransferQueueLedger as TransferQueueLedger

_LAZY = {
    "FlowControlLike": "._flow",
    "FlowControlModel": "._flow",
    "check_flow_control_schedule": "._flow",
    "flow_control_ops": "._flow",
    "ActorMachine": "._machine",
    "TrioStateMachine": "._machine",
    "in_trio": "._machine",
    "protocol_settings": "._machine",
    "FAULT_KINDS": "._soak",
    "FaultCampaign": "._soak",
    "FaultKind": "._soak",
    "FaultSchedule": "._soak",
    "InjectedFault": "._soak",
    "PlannedFault": "._soak",
    "fault_targets": "._soak",
    "node_base_name": "._soak",
    "open_fault_campaign": "._soak",
    "open_link_faults": "._soak",
    "roles_at": "._soak",
    "target_node": "._soak",
    "LedgerMissing": "._soak_run",
    "SoakResult": "._soak_run",
    "require_ledger": "._soak_run",
    "run_soak": "._soak_run",
    "ModelNode": "._supervision",
    "SupervisionModel": "._supervision",
    "supervision_trees": "._supervision",
    "supervisor_strategies": "._supervision",
    "LifecycleLog": "._supervision_machine",
    "LoggingSupervisor": "._supervision_machine",
    "LoggingWorker": "._supervision_machine",
    "SupervisionMachine": "._supervision_machine",
    "TransferQueueLedger": "._tq",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
