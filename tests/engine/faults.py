"""Forwards that fail on purpose, for the engine's failure tests: ``arm(engine, stage)`` makes
the next forward the engine executes raise ``InjectedFault`` at ``stage``.

The stages are the points of ``Engine._execute``, seen from the engine's model and cache
storage (their methods are wrapped on the instances, nothing in ``src/`` knows): before the
restore copies (the first storage write of a forward), after them (as the model is called),
after the model returned but before the save copies, and after the save copies (the last
state copy of a forward). Faults armed together fire in order, one per forward.
"""

from __future__ import annotations

import weakref
from collections import deque

FAULT_STAGES = ("before_restore", "after_restore", "before_save", "after_save")


class InjectedFault(RuntimeError):
    """Raised inside a forward by an armed fault."""


class _Faults:
    def __init__(self, engine) -> None:
        self.armed: deque[str] = deque()
        self.saving = False  # the model returned: the next copies are the forward's saves
        model, cache = engine.model, engine.cache
        forward, zero_state = model.forward, cache.zero_state
        copy_blocks, copy_states = cache.copy_blocks, cache.copy_states

        def faulty_forward(inputs, storage):
            self.fire("after_restore")
            outputs = forward(inputs, storage)
            self.saving = True
            self.fire("before_save")
            return outputs

        def restoring(copy):
            def faulty_copy(*args):
                if not self.saving:
                    self.fire("before_restore")
                return copy(*args)
            return faulty_copy

        def faulty_copy_states(*args):
            if not self.saving:
                self.fire("before_restore")
                return copy_states(*args)
            copy_states(*args)
            self.saving = False  # the save copies are done: the forward's last storage write
            self.fire("after_save")

        model.forward = faulty_forward
        cache.zero_state, cache.copy_blocks = restoring(zero_state), restoring(copy_blocks)
        cache.copy_states = faulty_copy_states

    def fire(self, stage: str) -> None:
        if self.armed and self.armed[0] == stage:
            self.armed.popleft()
            self.saving = False
            raise InjectedFault(stage)


def arm(engine, stage: str) -> None:
    """Make the next executed forward of ``engine`` raise at ``stage`` (one of ``FAULT_STAGES``)."""
    if stage not in FAULT_STAGES:
        raise ValueError(f"unknown fault stage {stage!r}")
    faults = _ARMED.get(engine)
    if faults is None:
        faults = _ARMED[engine] = _Faults(engine)
    faults.armed.append(stage)


_ARMED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> its wrapped model and storage
