"""The continuous-batching scheduler and its page allocator, without a model (pure page arithmetic)."""

from __future__ import annotations

import pytest

from sparrow_nemo.rollout.torch.block_manager import CHUNK_PAGES, BlockManager, OutOfPages, pages_for
from sparrow_nemo.rollout.torch.scheduler import Scheduler
from sparrow_nemo.rollout.torch.sequence import Sequence, Status

PS = 4


def seqs(prompt_lens: list[int], groups: list[int] | None = None, cap: int = 100) -> list[Sequence]:
    groups = groups or list(range(len(prompt_lens)))
    return [Sequence(i, g, p, cap) for i, (p, g) in enumerate(zip(prompt_lens, groups))]


def step(scheduler: Scheduler) -> list[Sequence]:
    """One decode step of the page arithmetic: pages for the pending token, then every running sequence
    caches it and samples one more. Returns the preempted."""
    preempted = scheduler.reserve(lambda s: s.cached + 1)
    for s in scheduler.running:
        s.cached += 1
        s.response.append(0)
    return preempted


def admit(scheduler: Scheduler) -> list:
    """Admit, and fill the admitted caches as the engine would (up to target_cached), first tokens sampled."""
    out = scheduler.admit()
    for a in out:
        a.prefix.computed = True
        a.seq.cached = a.seq.target_cached
        if not a.seq.response:
            a.seq.response.append(0)
    return out


def test_pages_are_counted_and_recycled() -> None:
    blocks = BlockManager(5, PS)
    a = blocks.allocate(3)
    assert a == [0, 1, 2] and blocks.num_free == 2 and blocks.peak_used == 3
    blocks.share(a[:2])
    blocks.release(a)
    assert blocks.num_free == 3  # pages 0 and 1 still held once
    blocks.release(a[:2])
    assert blocks.num_free == 5 and blocks.peak_used == 3
    with pytest.raises(OutOfPages, match="6 KV pages needed, 5 free of 5"):
        blocks.allocate(6)
    with pytest.raises(RuntimeError, match="already free"):
        blocks.release([0])
    assert pages_for(0, PS) == 0 and pages_for(1, PS) == 1 and pages_for(8, PS) == 2 and pages_for(9, PS) == 3


def test_sequences_growing_together_keep_their_pages_in_physical_runs() -> None:
    """Four sequences decoding in lockstep, a page each every PS steps: each one's pages lie in runs of a chunk
    (what the dense CPU pass streams), not interleaved page by page with the others' as a plain free list
    hands them out; every page is still one sequence's, and the counts are the scheduler's."""
    blocks = BlockManager(12 * CHUNK_PAGES, PS)
    scheduler = Scheduler(blocks, 8)
    group = seqs([PS] * 4, cap=1000)
    scheduler.add(group)
    admit(scheduler)
    for _ in range(2 * CHUNK_PAGES * PS):
        step(scheduler)
    pages = [p for s in group for p in s.pages]
    assert len(pages) == len(set(pages)) == blocks.num_used == 4 * (2 * CHUNK_PAGES + 1)
    for s in group:
        breaks = sum(b != a + 1 for a, b in zip(s.pages, s.pages[1:]))
        assert breaks <= len(s.pages) // CHUNK_PAGES, s.pages


def test_a_group_shares_its_prompt_pages_and_copies_the_tail() -> None:
    """Three samples of a 10-token prompt (2 full pages + a 2-token tail): the prefix holds 3 pages, each
    sample shares the 2 full ones and owns a tail copy: 3 + 3 pages, not 3 x 3."""
    blocks = BlockManager(20, PS)
    scheduler = Scheduler(blocks, 8)
    group = seqs([10, 10, 10], groups=[0, 0, 0])
    scheduler.add(group)
    admitted = admit(scheduler)
    assert len(admitted) == 3 and len({id(a.prefix) for a in admitted}) == 1
    prefix = admitted[0].prefix
    assert len(prefix.full) == 2 and prefix.tail is not None and prefix.users == 3
    assert blocks.num_used == 6
    assert all(s.pages[:2] == prefix.full and s.pages[2] not in prefix.pages for s in group)
    assert len({s.pages[2] for s in group}) == 3
    for s in group:
        scheduler.finish(s)
    assert blocks.num_used == 0 and not blocks.prefixes  # the last sample took the prefix with it


def test_admission_is_by_free_pages_not_a_row_count() -> None:
    """A 12-page pool: 8-token prompts take 2 pages each (no tail), so 5 sequences fit above the 1-page
    watermark; the sixth waits until one finishes. Nothing is reserved for tokens not yet written."""
    blocks = BlockManager(12, PS)
    scheduler = Scheduler(blocks, max_running=100)
    scheduler.add(seqs([8] * 6))
    assert len(admit(scheduler)) == 5 and len(scheduler.waiting) == 1
    assert blocks.num_used == 10
    scheduler.finish(scheduler.running[0])
    assert [a.seq.index for a in admit(scheduler)] == [5]


def test_max_running_caps_admission() -> None:
    scheduler = Scheduler(BlockManager(100, PS), max_running=2)
    scheduler.add(seqs([3, 3, 3]))
    assert len(admit(scheduler)) == 2 and len(scheduler.waiting) == 1


def test_growth_preempts_the_most_recent_admission_and_it_comes_back_first() -> None:
    """Three 4-token prompts in a 7-page pool: every step past a page boundary needs a page; when none is
    left the newest admission is preempted, returns to the front of the queue, and is readmitted with its
    cache up to its last sampled token (nothing it sampled is lost)."""
    blocks = BlockManager(7, PS)
    scheduler = Scheduler(blocks, 8)
    group = seqs([4, 4, 4])
    scheduler.add(group)
    assert len(admit(scheduler)) == 3
    preempted: list[Sequence] = []
    for _ in range(6):
        preempted += step(scheduler)
    assert preempted and preempted[0] is group[2] and group[2].status is Status.WAITING
    assert scheduler.waiting[0] is group[2] and group[2].pages == [] and group[2].cached == 0
    assert group[2].preemptions == 1 == scheduler.preemptions
    generated = group[2].num_generated
    scheduler.finish(group[0])
    readmitted = admit(scheduler)
    assert [a.seq for a in readmitted] == [group[2]]
    assert group[2].num_generated == generated and group[2].cached == 4 + generated - 1
    assert len(group[2].pages) == pages_for(group[2].cached, PS)


def test_idle_prefixes_are_evicted_before_anyone_is_preempted() -> None:
    """A prompt whose samples all wait keeps its prefix pages until the pool needs them: the running
    sequences grow into them instead of preempting each other."""
    blocks = BlockManager(6, PS)
    scheduler = Scheduler(blocks, max_running=1)
    scheduler.add(seqs([8, 8], groups=[0, 1]))
    admit(scheduler)
    blocks.attach(1, 8)  # the waiting prompt's prefix is cached (as after a preemption)
    blocks.detach(1)
    blocks.release(blocks.prefixes[1].full)  # its user's references are gone: only the prefix holds them
    assert blocks.prefixes[1].users == 0 and blocks.num_free == 2
    for _ in range(9):
        assert not step(scheduler)
    assert 1 not in blocks.prefixes and scheduler.preemptions == 0


def test_a_sequence_that_cannot_fit_alone_is_an_error() -> None:
    scheduler = Scheduler(BlockManager(3, PS), 8)
    scheduler.add(seqs([20]))
    with pytest.raises(OutOfPages, match=r"has 3 pages of 4 tokens; sample 0 needs 5 .*max_cache_tokens"):
        admit(scheduler)
    scheduler = Scheduler(BlockManager(3, PS), 8)
    scheduler.add(seqs([8]))
    admit(scheduler)
    with pytest.raises(OutOfPages, match="alone needs"):
        for _ in range(10):
            step(scheduler)
