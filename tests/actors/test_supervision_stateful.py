"""Supervision trees checked against the kit's plain-Python OTP model (``aft.SupervisionMachine``).

Random trees (a top supervisor with workers and possibly a nested supervisor, random strategies,
intensities, restart types and shutdown graces) take random schedules of crashes, normal exits,
explicit stops, tells, asks, concurrent bursts, clock jumps and workers stuck in a handler. The
model (``aft.SupervisionModel``) predicts the exact lifecycle log (every start and stop, in
order, and which stops end in a kill), restart counts, counters and which actors are alive; the
actor system runs in a helper thread under a ``MockClock`` that only moves when a rule moves it.
"""

from __future__ import annotations

from asyncflow_actors import testing as aft

TestSupervision = aft.SupervisionMachine.TestCase
TestSupervision.settings = aft.protocol_settings(max_examples=150, stateful_step_count=30)
