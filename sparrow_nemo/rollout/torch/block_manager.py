"""Who owns which KV page: a free list, reference counts and the shared prompt prefixes (no tensors).

The page pools themselves live in :class:`~sparrow_nemo.rollout.torch.paged_cache.PagedKVCache`; this module
only hands out page numbers, so the scheduler's dry mode runs it without a model.

A GRPO group's samples repeat one prompt. Its *prefix* is prefilled once into pages the prefix owns: the full
pages are then shared by every sample that decodes from it (a reference each, read-only: a sample writes only
past its prompt), the partial last page (the *tail*) is copied into a page of each sample's own, since the
sample's first response tokens land in it. A prefix lives while any sequence of its prompt is unfinished; an
*idle* one (no running sequence holds its pages) may be evicted to make room, and is prefilled again if a
sequence of its prompt is admitted later.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pops 0, 1, 2, ... first
        self._refs = [0] * num_pages
        self.prefixes: dict[int, Prefix] = {}
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        """Pages nobody holds."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, count: int) -> list[int]:
        """``count`` fresh pages (one reference each); raises :class:`OutOfPages` when fewer are free."""
        if count > len(self._free):
            raise OutOfPages(f"{count} KV pages needed, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.pop() for _ in range(count)]
        for p in pages:
            self._refs[p] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return pages

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
                self._free.append(p)

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
        own_tail = self.allocate(1) if prefix.tail is not None else []
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
