"""Where one turn's chunks end, as an admission policy plans them.

Owns no mutable state: a ``TurnPlan`` is a frozen value made when a turn starts, read by the
cache when its admission fixes the resume point (``stop_at``, handed to ``CacheProtocol.admit``)
and by whoever runs the turn's chunks (``ends``). The chunks are the prefill grid from the
resume point (chunks of ``chunk`` tokens, as the engine's scheduler cuts them), also ended at
every checkpoint the admission policy plans, at the prompt end and at the turn's last token.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridcache.policies.admission import TurnView, first_end, kind_of_step


@dataclass(frozen=True)
class TurnPlan:
    """``admission``: the policy (``save_steps``); ``branch``: whole-block tokens of the prompt the
    cache held as KV when the turn was prepared; ``final_end``: the last position processed."""

    admission: object
    chunk: int
    prompt_length: int
    final_end: int
    branch: int
    block_size: int

    def view(self, start: int) -> TurnView:
        return TurnView(start, self.prompt_length, self.final_end, min(self.branch, self.prompt_length), self.block_size)

    def stop_at(self, start: int) -> int:
        """The end of the first chunk of a turn resumed at ``start``."""
        view = self.view(start)
        return min(start + self.chunk, first_end(self.admission.save_steps(view), view))

    def ends(self, start: int, first: int) -> tuple[list[int], list[int], dict[int, str]]:
        """For a turn resumed at ``start`` whose first chunk ends at ``first``: the chunk ends
        from ``first`` on, of the prompt and of the output, and the reason of every planned
        checkpoint among them."""
        view = self.view(start)
        saves = self.admission.save_steps(view)
        grid = range(start + self.chunk, self.prompt_length, self.chunk)
        ends = sorted(end for end in {first, *saves, *grid, self.prompt_length, self.final_end} if end >= first)
        kinds = {end: kind_of_step(view, end) for end in saves if end >= first}
        prompt_ends = [end for end in ends if end <= self.prompt_length]
        return prompt_ends, ends[len(prompt_ends):], kinds
