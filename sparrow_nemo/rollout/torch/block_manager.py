"""Who owns which KV page: a free list, reference counts and the shared prompt prefixes (no tensors).

The page pools themselves live in :class:`~sparrow_nemo.rollout.torch.paged_cache.PagedKVCache`; this module
only hands out page numbers, so the scheduler's dry mode runs it without a model.

*Which* free page a sequence gets does not change what is scheduled (that counts pages only), but it decides
how the attention reads memory: the dense decode pass walks each row's pages in order, and on the CPU a row
whose pages lie in one physical run streams from memory, while pages handed out one at a time to rows that
grow in lockstep interleave (row b's consecutive pages a batch apart), and the pass stalls at every page.
So an allocation continues the physical run of the page it follows (``after``: the caller's last page) when
the next page is free, and otherwise starts a new run at the head of an untouched chunk of ``CHUNK_PAGES``
pages; only when no such chunk is left does it take the lowest free page. No page is reserved: the pages
after a sequence's run stay free for anyone (admission and growth see every free page), so placement is
invisible to the scheduler, and with it to samples, preemptions and step counts.

A GRPO group's samples repeat one prompt. Its *prefix* is prefilled once into pages the prefix owns: the full
pages are then shared by every sample that decodes from it (a reference each, read-only: a sample writes only
past its prompt), the partial last page (the *tail*) is copied into a page of each sample's own, since the
sample's first response tokens land in it. A prefix lives while any sequence of its prompt is unfinished; an
*idle* one (no running sequence holds its pages) may be evicted to make room, and is prefilled again if a
sequence of its prompt is admitted later.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

#: pages per chunk: a sequence whose run is blocked starts a new one at the head of a wholly free chunk
#: (16 pages of 16 tokens: 256 tokens, 64 KiB per layer of one head group's keys at D = 128 in fp32)
CHUNK_PAGES = 16


class OutOfPages(RuntimeError):
    """More pages were asked for than are free."""


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold ``tokens`` tokens."""
    return -(-tokens // page_size)


@dataclass(eq=False)
class Prefix:
    """A distinct prompt's cached keys and values.

    Attributes:
        prompt_id: the prompt it caches; prompt_len: its tokens.
        full: pages holding whole pages of the prompt (shared by its users).
        tail: the page holding the prompt's last ``prompt_len % page_size`` tokens, or None when it fills whole pages.
        users: running sequences that hold references to ``full``.
        computed: its keys and values have been written (False between allocation and the prefill).
    """

    prompt_id: int
    prompt_len: int
    full: list[int] = field(default_factory=list)
    tail: int | None = None
    users: int = 0
    computed: bool = False

    @property
    def pages(self) -> list[int]:
        """Every page it owns, in logical order."""
        return self.full + ([] if self.tail is None else [self.tail])


class BlockManager:
    """Page numbers ``0 .. num_pages - 1`` with reference counts, and the live prompt prefixes.

    Args:
        num_pages: pages in the pool; page_size: tokens per page.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(
                f"BlockManager: num_pages and page_size must be > 0, got {num_pages}, {page_size}"
            )
        self.num_pages = num_pages
        self.page_size = page_size
        self._refs = [0] * num_pages
        self._num_free = num_pages
        chunks = -(-num_pages // CHUNK_PAGES)
        self._chunk_free = [min(CHUNK_PAGES, num_pages - c * CHUNK_PAGES) for c in range(chunks)]
        self._whole = list(range(chunks - 1, -1, -1))  # wholly free chunks (a stack, lazily checked)
        self._lowest = list(range(num_pages))  # a min-heap of free pages (lazily checked; may repeat)
        self.prefixes: dict[int, Prefix] = {}
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        """Pages nobody holds."""
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_pages - self._num_free

    def allocate(self, count: int, after: int | None = None) -> list[int]:
        """``count`` fresh pages (one reference each), placed to continue the physical run of page ``after``
        (the caller's last page; None: a new run), see the module docstring. Raises :class:`OutOfPages` when
        fewer are free."""
        if count > self._num_free:
            raise OutOfPages(f"{count} KV pages needed, {self._num_free} free of {self.num_pages}")
        pages = []
        for _ in range(count):
            after = self._next_page(after)
            self._refs[after] = 1
            self._chunk_free[after // CHUNK_PAGES] -= 1
            pages.append(after)
        self._num_free -= count
        self.peak_used = max(self.peak_used, self.num_used)
        return pages

    def _whole_chunk(self, c: int) -> bool:
        return self._chunk_free[c] == min(CHUNK_PAGES, self.num_pages - c * CHUNK_PAGES)

    def _next_page(self, after: int | None) -> int:
        """The free page an allocation takes next: ``after + 1``, else the head of a wholly free chunk, else
        the lowest free page (at least one page is free)."""
        if after is not None and after + 1 < self.num_pages and self._refs[after + 1] == 0:
            return after + 1
        while self._whole:
            c = self._whole.pop()
            if self._whole_chunk(c):
                return c * CHUNK_PAGES
        while self._refs[self._lowest[0]]:
            heapq.heappop(self._lowest)
        return heapq.heappop(self._lowest)

    def share(self, pages: list[int]) -> None:
        """One more reference to each of ``pages`` (held pages only)."""
        for p in pages:
            if self._refs[p] <= 0:
                raise RuntimeError(f"BlockManager.share: page {p} is free")
            self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one reference to each of ``pages``; a page nobody holds goes back to the free list."""
        for p in reversed(pages):
            if self._refs[p] <= 0:
                raise RuntimeError(f"BlockManager.release: page {p} is already free")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._num_free += 1
                self._chunk_free[p // CHUNK_PAGES] += 1
                if self._whole_chunk(p // CHUNK_PAGES):
                    self._whole.append(p // CHUNK_PAGES)
                heapq.heappush(self._lowest, p)

    # ----------------------------------------------------------------- prefixes
    def prefix_cost(self, prompt_id: int, prompt_len: int) -> int:
        """Pages a new user of ``prompt_id``'s prefix needs before its own tokens: the prefix's pages when it is
        not cached, plus the user's copy of the tail."""
        full, rem = divmod(prompt_len, self.page_size)
        tail = 1 if rem else 0
        return tail + (0 if prompt_id in self.prefixes else full + tail)

    def attach(self, prompt_id: int, prompt_len: int) -> tuple[Prefix, list[int]]:
        """A new user of the prefix of ``prompt_id`` (created, with fresh pages, when not cached) -> (the prefix,
        the user's pages: the shared full pages, then its own tail copy when the prompt has a tail). The caller
        must have checked :meth:`prefix_cost` pages are free."""
        prefix = self.prefixes.get(prompt_id)
        if prefix is None:
            full, rem = divmod(prompt_len, self.page_size)
            pages = self.allocate(full + (1 if rem else 0))
            prefix = Prefix(prompt_id, prompt_len, full=pages[:full], tail=pages[full] if rem else None)
            self.prefixes[prompt_id] = prefix
        self.share(prefix.full)
        prefix.users += 1
        own_tail = self.allocate(1, after=prefix.tail) if prefix.tail is not None else []
        return prefix, prefix.full + own_tail

    def detach(self, prompt_id: int) -> None:
        """A user of the prefix of ``prompt_id`` left (its pages are released by the caller)."""
        self.prefixes[prompt_id].users -= 1

    def drop(self, prompt_id: int) -> None:
        """Forget the prefix of ``prompt_id`` (no sequence of that prompt remains): its own references go."""
        prefix = self.prefixes.pop(prompt_id, None)
        if prefix is not None:
            self.release(prefix.pages)

    def evict_idle(self, needed: int, keep: int | None = None) -> None:
        """Drop idle prefixes (no running user), oldest first, until ``needed`` pages are free or none is left;
        the prefix of prompt ``keep`` stays."""
        for prompt_id in [p for p, x in self.prefixes.items() if x.users == 0 and p != keep]:
            if self.num_free >= needed:
                return
            self.drop(prompt_id)
