"""Continuous batching: which sequences run each step, given the free KV pages (no tensors).

The engine's step loop (and its dry mode, :mod:`sparrow_nemo.rollout.torch.dry_run`) calls, per step:

1. :meth:`Scheduler.admit`: waiting sequences join, in queue order, while the pages for their cache (the
   prompt prefix, shared within a GRPO group, and for a preempted sequence the response it already has) fit
   above a small watermark and fewer than ``max_running`` run; nothing is reserved for tokens not yet written;
2. :meth:`Scheduler.reserve`: every running sequence gets the pages its next step writes (one token, or a
   speculative round's k + 1); when the pool is short, idle prefixes are evicted and then the most recently
   admitted sequence is *preempted*: its pages are freed and it goes back to the front of the queue, to
   recompute its cache when it is admitted again (nothing it sampled is lost);
3. the engine runs the step and calls :meth:`finish` for the sequences that ended.

A sequence that cannot fit in an otherwise empty pool is an error naming the pool's size.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sparrow_nemo.rollout.torch.block_manager import BlockManager, OutOfPages, Prefix, pages_for
from sparrow_nemo.rollout.torch.sequence import Sequence, Status

#: share of the pool kept free when admitting (vLLM's watermark): room for the running sequences to grow
WATERMARK = 0.01


@dataclass(eq=False)
class Admission:
    """A sequence admitted this step, with the prefix it decodes from (prefilled now if not ``computed``)."""

    seq: Sequence
    prefix: Prefix


class Scheduler:
    """The waiting queue, the running set and their pages.

    Args:
        blocks: the page allocator (its prefixes are the prompt caches).
        max_running: the most sequences that run at once (the engine's ``max_batch_size``).
    """

    def __init__(self, blocks: BlockManager, max_running: int) -> None:
        if max_running <= 0:
            raise ValueError(f"Scheduler: max_running must be > 0, got {max_running}")
        self.blocks = blocks
        self.max_running = max_running
        self.watermark = max(1, int(WATERMARK * blocks.num_pages))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._unfinished: Counter[int] = Counter()
        self._clock = 0
        self.preemptions = 0

    @property
    def done(self) -> bool:
        """No sequence waits or runs."""
        return not self.waiting and not self.running

    def add(self, seqs: Iterable[Sequence]) -> None:
        """Queue ``seqs`` (in order) for admission."""
        for seq in seqs:
            seq.status = Status.WAITING
            self.waiting.append(seq)
            self._unfinished[seq.prompt_id] += 1

    def _pages_needed(self, seq: Sequence) -> int:
        """Pages admitting ``seq`` takes: its prompt's prefix when not cached, its copy of the prefix's tail and
        its own pages up to ``target_cached`` tokens."""
        full, rem = divmod(seq.prompt_len, self.blocks.page_size)
        own = pages_for(seq.target_cached, self.blocks.page_size) - full - (1 if rem else 0)
        return self.blocks.prefix_cost(seq.prompt_id, seq.prompt_len) + own

    def admit(self) -> list[Admission]:
        """Admit waiting sequences in queue order while their pages fit (see the module docstring)."""
        admitted: list[Admission] = []
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            need = self._pages_needed(seq)
            floor = need + (self.watermark if self.running else 0)
            if self.blocks.num_free < floor:
                self.blocks.evict_idle(floor, keep=seq.prompt_id)
            if self.blocks.num_free < floor:
                if not self.running:
                    raise OutOfPages(
                        f"the KV cache has {self.blocks.num_pages} pages of {self.blocks.page_size} tokens; sample "
                        f"{seq.index} needs {need} for its {seq.target_cached} cached tokens alone: raise "
                        "rollout.max_cache_tokens (or rollout.kv_cache_fraction)"
                    )
                break
            self.waiting.popleft()
            prefix, pages = self.blocks.attach(seq.prompt_id, seq.prompt_len)
            extra = pages_for(seq.target_cached, self.blocks.page_size) - len(pages)
            seq.pages = pages + self.blocks.allocate(max(extra, 0), after=pages[-1] if pages else None)
            seq.cached = 0  # the engine fills the cache up to target_cached
            seq.status = Status.RUNNING
            seq.admitted_at = self._clock
            self._clock += 1
            self.running.append(seq)
            admitted.append(Admission(seq, prefix))
        return admitted

    def reserve(self, tokens_after: Callable[[Sequence], int]) -> list[Sequence]:
        """Give every running sequence pages for ``tokens_after(seq)`` cached tokens (its next step), oldest
        admission first, preempting the newest when the pool runs short. Returns the preempted sequences (they
        are back at the front of the queue, oldest first)."""
        preempted: list[Sequence] = []
        ps = self.blocks.page_size  # pages_for inline below: it runs for every sequence every step
        for seq in list(self.running):  # admission order (``running`` only ever appends admissions)
            need = -(-tokens_after(seq) // ps) - len(seq.pages)
            if need <= 0 or seq.status is not Status.RUNNING:
                continue
            while need > self.blocks.num_free:
                self.blocks.evict_idle(need)
                if need <= self.blocks.num_free:
                    break
                victim = self.running[-1]  # the most recent admission
                if victim is seq and len(self.running) == 1:
                    raise OutOfPages(
                        f"the KV cache has {self.blocks.num_pages} pages of {self.blocks.page_size} tokens; sample "
                        f"{seq.index} alone needs {len(seq.pages) + need} at {tokens_after(seq)} cached tokens: "
                        "raise rollout.max_cache_tokens (or rollout.kv_cache_fraction)"
                    )
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                seq.pages += self.blocks.allocate(need, after=seq.pages[-1] if seq.pages else None)
        return preempted[::-1]

    def _leave(self, seq: Sequence) -> None:
        """Release ``seq``'s pages and its place in the running set."""
        self.blocks.release(seq.pages)
        self.blocks.detach(seq.prompt_id)
        seq.pages = []
        seq.cached = 0
        self.running.remove(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._leave(seq)
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """``seq`` ended: its pages go back, and its prompt's prefix when no sequence of that prompt remains."""
        self._leave(seq)
        seq.status = Status.FINISHED
        self._unfinished[seq.prompt_id] -= 1
        if self._unfinished[seq.prompt_id] == 0:
            self.blocks.drop(seq.prompt_id)
