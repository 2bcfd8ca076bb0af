"""When a paged run with a second tier first moves a request's blocks out, known before the run gets there.

A queue whose requests each run to their token budget (ignore_eos: the mixed queue) has lengths that do not depend
on the tokens drawn, so the server's own scheduling, replayed without the model's pass, takes the same steps as the
real run. Replayed with every victim computed again, it matches the tier run up to the first preemption whose
victim holds at least the crossover's positions: that step is the one at which the tier run moves blocks out (the
tier has a slot for every block of the pool, so the first move always fits).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from model.engine.runtime import NativeModel
from model.serving.engine import Engine, EngineSettings
from model.serving.request import Request


class FirstMove(NamedTuple):
    step: int          # the step whose scheduling moves the blocks out
    request: int       # the victim
    positions: int     # the positions it holds then


class _Replay(Engine):
    """The server's scheduling with no model pass: each span's positions counted computed, a token (0) emitted
    where a span reaches its request's last position; every victim computed again, the first one holding at least
    `swap_from` positions noted."""

    def __init__(self, model: NativeModel, requests: list[Request], settings: EngineSettings, swap_from: int):
        super().__init__(model, requests, dataclasses.replace(settings, offload=None, swap_from=None))
        self.swap_from, self.index, self.first = swap_from, 0, None

    def _preempt(self, seq: Request, tier: list[tuple[int, str]]) -> None:
        if self.first is None and seq.computed >= self.swap_from:
            self.first = FirstMove(self.index, seq.id, seq.computed)
        super()._preempt(seq, tier)

    def replay(self) -> FirstMove | None:
        while not self.finished and self.first is None:
            plan = self._schedule(self.index)
            by_id = {seq.id: seq for seq in self.running}
            for span in plan.spans:
                seq = by_id[span.request]
                seq.computed = span.stop
                if span.stop == len(seq.tokens):
                    seq.emit(0, self.index, 0.0, None, self.info.context_length)
            for span in plan.spans:
                if self.settings.prefix_cache:
                    self.cache.cache_blocks(by_id[span.request])
                self.cache.free_out_of_window(by_id[span.request])
            for seq in [s for s in self.running if s.stop_reason is not None]:
                self.cache.free(seq)
                self.running.remove(seq)
            self.index += 1
        return self.first


def first_move_out(model: NativeModel, requests: list[Request], settings: EngineSettings,
                   swap_from: int | None) -> FirstMove | None:
    """The step, victim and positions of the tier run's first move out; None when none comes (no victim holds
    `swap_from` positions, or swap_from is None: nothing moves), or when a request may end at an eos (its length,
    and so the schedule, then depends on the tokens)."""
    if swap_from is None or not all(r.ignore_eos for r in requests):
        return None
    return _Replay(model, [dataclasses.replace(r).restart() for r in requests], settings, swap_from).replay()
