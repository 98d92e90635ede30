"""Prefetch: the units under one outer fully_shard call share a Schedule that
records their forward order; from the second forward on, a unit starting its
forward starts the all-gather of the unit after it, and a unit starting its
backward starts the all-gather of the unit before it, so the gather overlaps
compute. A unit given explicit lists (set_modules_to_forward_prefetch /
set_modules_to_backward_prefetch) prefetches those instead. Every rank must run
the units in the same order (as with any FSDP). set_prefetch(model, False) turns
prefetching off (to measure the overlap).

The schedule also knows when a backward is running (from the first unit's
pre-backward hook to the end of that backward): a unit's forward then is
activation checkpointing's recomputation."""
import torch


class Schedule:
    def __init__(self, units):
        self.units = units
        self.order, self.recording = [], []
        self.prefetching = True
        self.in_backward = False
        self.reducing = None  # the unit whose reduce-scatter is in flight
        for u in units:
            u.schedule = self

    def root_pre_forward(self, module, args):
        self.recording = []

    def root_post_forward(self, module, args, output):
        self.order = self.recording
        for u in self.units:
            u.settle()

    def _neighbour(self, unit, step):
        try:
            i = self.order.index(unit) + step
        except ValueError:
            return None
        return self.order[i] if 0 <= i < len(self.order) else None

    def targets(self, unit, explicit, step):
        """The units to prefetch when `unit` starts its forward (step 1) or backward
        (step -1): the explicit list if given, else its neighbour in the recorded order."""
        if not self.prefetching:
            return []
        if explicit is not None:
            return explicit
        nxt = self._neighbour(unit, step)
        return [nxt] if nxt is not None and nxt is not unit else []

    def forward_started(self, unit):
        self.recording.append(unit)

    def backward_started(self, unit):
        if not self.in_backward:
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self):
        self.in_backward = False
        for u in self.units:
            u.settle()
