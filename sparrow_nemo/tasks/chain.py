"""The synthetic verifiable task: follow a chain of pointers through a table given early in the prompt.

Nodes are names of ``name_length`` upper-case letters (1: at most 26 nodes; 2: up to 676, for chains of
hundreds of hops). The prompt holds a table of ``num_nodes`` entries in random order, then the start node.
``Kn5`` = node ``K`` points to node ``N`` (written lower-case) and the edge adds 5; ``K.`` = node ``K``
ends its chain::

    (Ax3,Q.,Xq5,B.)\n?A\n              two-letter names: (KQmb5,MB.,...)\n?KQ\n

The reference solution walks the chain, copying each visited entry followed by the running sum mod 10 of
the edge digits, and ends with the answer = the chain's last node + the final sum::

    Ax3=3 Xq5=8 Q.\n!Q8

With two-letter names a hop is 8 characters of solution (``KQmb5=3 ``) and a table entry 6, so 150 hops
make a ~1,200-token solution whose every hop reads its successor and digit from a table up to ~2,000
tokens back.

Why it suits sparse rollout: no node is visited twice in a walk, so each step's successor and digit (2 of its
6 characters) can only be read from the table in the prompt (or, with several queries, an earlier walk
through the same entry), far back, while the other characters are local copies or a local sum. Dropping the right page hurts those few tokens badly while most stay easy (the skewed
per-token mismatch of the paper), and the completion length (6 characters per hop) varies with the number
of hops. The nodes not on the queried chain form other chains that also end in ``.``, so the end of the
chain cannot be found without walking it.

Why a tiny model can learn it: both look-ups of a step are plain induction (find the earlier occurrence of
the current token, copy the token after it). The upper-case node occurs once in the table, followed by its
successor; the lower-case successor occurs once in the table, followed by the digit.

The haystack (``filler_tokens``): the same table with its entries scattered through runs of :data:`FILLER`
characters, which never occur in an entry, the trace or the answer, so every look-up still has exactly one
match while the KV cache grows to ~1K+ tokens and each hop needs a handful of table pages among dozens of
filler pages (what top-k page selection is good at)::

    (;*+Ax3,->>;:Q.,*Xq5,;;-+:*B.:>)\n?A\n

Stripping the filler gives back, character for character, the problem drawn without it.

Several queries (``num_queries`` max > 1), the long-context miniature (``recipes/tiny_cpu.yaml``): one
table, the nodes cut into chains of ``num_hops`` hops each, and Q labelled start nodes answered in turn, so
the response grows to hundreds or thousands of tokens from a ~140-token prompt while every hop still reads
the table (or an earlier walk through the same entry) far back. The labels are single letters
beyond the node alphabet (:func:`query_labels`, here ``ÀÁÂ``); label Q closes the list with END::

    (Ax3,Q.,Xq5,B.)\nÀx,Áa,Â.\n          ÀXq5=5À Q.\n!Q5\nÁAx3=3Á Xq5=8Á Q.\n!Q8\nÂ.

Each walk starts with its label and the start node copied from after that label in the prompt (one
induction), ends each step with the label and a space (so the label is never more than a step back: the next
walk's label, the next in a fixed order, is a local read; the space keeps the token after an in-walk label
unlike the prompt's, where a start node follows) and ends with its answer; after the last walk the next
label's entry says END. The reward is the fraction of queries answered right
(:func:`chain_reward`), so "accuracy" (reward 1) means every query right.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import re
import string
from collections.abc import Iterator
from dataclasses import dataclass, field

from sparrow_nemo.config.schema import AT_LEAST_ONE, NON_NEGATIVE, Section, interval, knob
from sparrow_nemo.rewards.registry import register_reward
from sparrow_nemo.tasks.tokenizer import MAX_LETTERS, alphabet

NODE_NAMES = string.ascii_uppercase
END = "."
#: haystack characters: in the tokenizer's CHARSET (one token each) and never in an entry, a trace or an answer
FILLER = ":;>+-*"
_ANSWER_RE = re.compile(r"!(\S*)")
#: a walk's label (the first character of its line) and the answer on the line after it
_LABELLED_ANSWER_RE = re.compile(r"(?:^|\n)([^\s!])[^\n]*\n!(\S*)")


def node_names(name_length: int, letters: int = 26) -> list[str]:
    """Every node name of ``name_length`` letters of :func:`~sparrow_nemo.tasks.tokenizer.alphabet`
    ``(letters)``, in order (letters ** name_length names)."""
    return ["".join(chars) for chars in itertools.product(alphabet(letters), repeat=name_length)]


def _entry_re(name_length: int, letters: int) -> re.Pattern[str]:
    """A table entry: node name, then successor (lower case) and digit, or END."""
    upper = re.escape(alphabet(letters))
    lower = re.escape(alphabet(letters).lower())
    return re.compile(rf"([{upper}]{{{name_length}}})(?:([{lower}]{{{name_length}}})(\d)|\.)")


@dataclass(frozen=True)
class ChainProblem:
    """One problem. ``prompt`` and ``trace`` are plain text (the tokenizer adds bos; the trace is followed by
    eos); ``answer`` is the answers :func:`parse_answers` must return (space-separated, one per query) for the
    completion to earn reward 1. ``num_hops``: hops over all the walks."""

    prompt: str
    trace: str
    answer: str
    num_nodes: int
    num_hops: int
    num_queries: int = 1


@dataclass(frozen=True)
class ChainTaskConfig(Section):
    """Difficulty knobs (the recipe's ``task`` section); each problem draws its sizes uniformly from the
    inclusive ranges. With name length L and one query the prompt has (2L + 2) * num_nodes + L + 4 - L *
    (number of chains) characters (plus the filler) and the trace (2L + 4) * (num_hops + 1); several queries
    add 3 prompt characters per query and 1 trace character per hop."""

    num_nodes: tuple[int, ...] = knob(
        (8, 26),
        "(min, max) table entries per problem (at most letters ** name_length: 26 with one-letter names)",
        check=interval(2, MAX_LETTERS**3),
    )
    num_hops: tuple[int, ...] = knob(
        (2, 25),
        "(min, max) pointer hops on the queried chain (with several queries: of each chain of the table), clamped "
        "to num_nodes - 1 (2 * name_length + 4 response characters per hop, one more with several queries)",
        check=AT_LEAST_ONE,
    )
    seed: int = knob(0, "problems are a pure function of (seed, index)", check=NON_NEGATIVE)
    name_length: int = knob(
        1,
        "letters per node name: 1 = single letters (the original task), 2 = chains of hundreds",
        check=interval(1, 3),
    )
    letters: int = knob(
        26,
        "size of the names' alphabet: 26 = A-Z; more adds non-ASCII letters with a one-character lower case "
        "(sparrow_nemo.tasks.tokenizer.alphabet: one token each, so the model's vocab_size must hold "
        "80 + 2 * (letters - 26) ids, letters counting the query labels: tokenizer_letters)",
        check=interval(26, MAX_LETTERS),
    )
    filler_tokens: tuple[int, ...] = knob(
        (0, 0),
        "(min, max) FILLER characters (one token each) scattered between the prompt table's entries: a haystack "
        "that makes the KV cache long while the look-ups stay as easy; (0, 0) = none (the original problems)",
        check=NON_NEGATIVE,
    )
    num_queries: tuple[int, ...] = knob(
        (1, 1),
        "(min, max) labelled queries about one table, answered in turn, from distinct start nodes (clamped to "
        "the table's size; a max > 1 switches to that format, with chains of num_hops hops each; the labels take "
        "max + 1 letters after the node alphabet); (1, 1) = the original single-query problems",
        check=AT_LEAST_ONE,
    )

    fact_copies: int = knob(
        1,
        "times the table is written (each copy in its own order, an entry's copies at least half a copy apart): "
        "every fact stated that often, so a look-up that misses one copy's page can read another; 1 = once",
        check=interval(1, 3),
    )
    any_order: bool = knob(
        False,
        "several-query problems only: the reference traces answer the queries in a random order (a genuine fork: "
        "which query next), and the reward matches answers to queries by label; false = in label order",
    )
    max_wrong: int = knob(
        0,
        "the fragility knob: queries a problem may get wrong and still count as solved (reward 1.0; more wrong "
        "scores the fraction right); 0 = every query must be right (the fragile setting)",
        check=NON_NEGATIVE,
    )
    slip_rate: float = knob(
        0.0,
        "probability per hop that a reference trace writes a wrong running sum and carries on from it: "
        "demonstrations with mistakes, which a warm-start imitates (its own stream; answers stay the true ones); "
        "0 = exact traces",
        check=interval(0.0, 1.0),
    )

    @property
    def multi_query(self) -> bool:
        """Whether problems use the labelled several-query format."""
        return self.num_queries[1] > 1

    @property
    def tokenizer_letters(self) -> int:
        """Letters the tokenizer must hold: the node alphabet, plus the query labels in the several-query format."""
        return self.letters + (self.num_queries[1] + 1 if self.multi_query else 0)

    def check(self) -> None:
        for key in ("num_nodes", "num_hops", "filler_tokens", "num_queries"):
            value = getattr(self, key)
            if len(value) != 2 or value[0] > value[1]:
                raise self.invalid(key, "two integers [min, max] with min <= max")
        most = self.letters**self.name_length
        if self.num_nodes[1] > most:
            raise self.invalid(
                "num_nodes",
                f"a maximum <= {most} ({self.name_length}-letter names of {self.letters} letters)",
            )
        if self.num_hops[0] > self.num_nodes[1] - 1:
            raise self.invalid("num_hops", f"a minimum <= num_nodes max - 1 ({self.num_nodes[1] - 1})")
        if self.any_order and not self.multi_query:
            raise self.invalid("any_order", "true only with several queries (num_queries max > 1)")
        if self.tokenizer_letters > MAX_LETTERS:
            raise self.invalid(
                "num_queries",
                f"letters + max + 1 <= {MAX_LETTERS} (labels are letters after the node alphabet)",
            )


@dataclass(frozen=True)
class Writing:
    """How a problem is written, apart from its graph: node names of ``name_length`` of the first ``letters``
    letters, ``filler`` :data:`FILLER` characters scattered between the table's entries (drawn after everything
    else: the same problem, with a haystack), reference traces whose running sum slips at ``slip_rate`` per
    hop, drawing from ``slips`` (:func:`_walk`); for several-query problems, the table written ``copies`` times
    and, with ``any_order``, the walks in an order drawn from ``order`` (:func:`make_multi_problem`)."""

    name_length: int = 1
    letters: int = 26
    filler: int = 0
    slip_rate: float = 0.0
    slips: random.Random | None = field(default=None, compare=False)
    copies: int = 1
    any_order: bool = False
    order: random.Random | None = field(default=None, compare=False)

    def pool(self) -> list[str]:
        """The node names this writing draws from."""
        if (self.name_length, self.letters) == (1, 26):
            return NODE_NAMES
        return node_names(self.name_length, self.letters)


def make_problem(
    rng: random.Random, num_nodes: int, num_hops: int, writing: Writing = Writing()
) -> ChainProblem:
    """A problem with ``num_nodes`` table entries whose queried chain has ``num_hops`` hops (<= num_nodes - 1),
    written as ``writing`` says."""
    pool = writing.pool()
    if not (1 <= num_hops <= num_nodes - 1 and num_nodes <= len(pool)):
        raise ValueError(
            f"need 1 <= num_hops <= num_nodes - 1 <= {len(pool) - 1}, got num_nodes={num_nodes}, num_hops={num_hops}"
        )
    names = rng.sample(pool, num_nodes)
    digit = {k: rng.randrange(10) for k in names}
    succ: dict[str, str] = {}
    path, rest = names[: num_hops + 1], names[num_hops + 1 :]
    _link(path, succ)
    while rest:  # the other nodes form chains of random lengths, each ending in END
        cut = rng.randint(1, len(rest))
        _link(rest[:cut], succ)
        rest = rest[cut:]
    order = names[:]
    rng.shuffle(order)
    table = _scatter(rng, [_entry(k, succ, digit) for k in order], writing.filler)
    trace, answer, _ = _walk(path[0], succ, digit, slips=writing.slips, slip_rate=writing.slip_rate)
    return ChainProblem(
        prompt=f"({table})\n?{path[0]}\n", trace=trace, answer=answer, num_nodes=num_nodes, num_hops=num_hops
    )


def query_labels(letters: int, count: int) -> str:
    """The ``count`` single-letter query labels of a task whose nodes use the first ``letters`` letters: the
    letters after them (:func:`~sparrow_nemo.tasks.tokenizer.alphabet`), so a label never names a node."""
    return alphabet(letters + count)[letters:]


def make_multi_problem(
    rng: random.Random, num_nodes: int, hops: tuple[int, int], num_queries: int, writing: Writing = Writing()
) -> ChainProblem:
    """A several-query problem (module docstring): ``num_nodes`` entries cut into chains of ``hops`` = (min, max)
    hops each (the last chain takes what is left), ``num_queries`` distinct start nodes, written as ``writing``
    says. ``num_hops`` of the result is the total over the walks.

    ``writing.copies`` > 1 writes the table that many times, ``(...)(...)``, each later copy from
    :func:`_recopy`; ``writing.any_order`` walks the queries in a random order (drawn from ``writing.order``) and
    labels the answer, ``À=Q5 Á=B8`` (:func:`chain_reward` then matches answers to queries by label). Neither
    draws from ``rng``: with one copy in label order the problem is the one without them."""
    pool = writing.pool()
    if not (1 <= num_queries <= num_nodes <= len(pool) and 1 <= hops[0] <= hops[1]):
        raise ValueError(
            f"need 1 <= num_queries <= num_nodes <= {len(pool)} and 1 <= hops min <= max, got "
            f"num_nodes={num_nodes}, num_queries={num_queries}, hops={hops}"
        )
    names = rng.sample(pool, num_nodes)
    digit = {k: rng.randrange(10) for k in names}
    succ: dict[str, str] = {}
    rest = names
    while rest:
        cut = rng.randint(*hops) + 1
        _link(rest[:cut], succ)
        rest = rest[cut:]
    order = names[:]
    rng.shuffle(order)
    starts = rng.sample(names, num_queries)  # after the table's draws: the table does not depend on the count
    entries = [_entry(k, succ, digit) for k in order]
    table = _scatter(rng, entries, writing.filler)
    tables = [table, *(_scatter(writing.order, _recopy(writing.order, entries), writing.filler)
                       for _ in range(writing.copies - 1))]  # fmt: skip
    labels = query_labels(writing.letters, num_queries + 1)
    queries = ",".join(
        [*(f"{label}{node.lower()}" for label, node in zip(labels, starts)), f"{labels[-1]}{END}"]
    )
    walks = [
        (label, *_walk(node, succ, digit, f"{label} ", writing.slips, writing.slip_rate))
        for label, node in zip(labels, starts)
    ]
    answers = [f"{label}={answer}" if writing.any_order else answer for label, _, answer, _ in walks]
    if writing.any_order:
        writing.order.shuffle(walks)
    trace = "".join(f"{label}{walk}\n" for label, walk, _, _ in walks) + f"{labels[-1]}{END}"
    return ChainProblem(
        prompt="".join(f"({t})" for t in tables) + f"\n{queries}\n",
        trace=trace,
        answer=" ".join(answers),
        num_nodes=num_nodes,
        num_hops=sum(n for *_, n in walks),
        num_queries=num_queries,
    )


def _walk(
    start: str,
    succ: dict[str, str],
    digit: dict[str, int],
    sep: str = " ",
    slips: random.Random | None = None,
    slip_rate: float = 0.0,
) -> tuple[str, str, int]:
    """(trace, answer, hops) of the walk from ``start`` to its chain's END: each visited entry followed by the
    running sum mod 10 of the edge digits (the steps joined by ``sep``), then the final node and sum; ``answer``
    is the true one. With ``slip_rate`` > 0 each step's written sum is off by 1-9 with that probability (draws
    from ``slips``) and the trace carries on from the written value: a demonstration with mistakes."""
    steps, total, written, node = [], 0, 0, start
    while succ[node] != END:
        total = (total + digit[node]) % 10
        written = (written + digit[node]) % 10
        if slip_rate and slips.random() < slip_rate:
            written = (written + slips.randint(1, 9)) % 10
        steps.append(f"{_entry(node, succ, digit)}={written}")
        node = succ[node]
    return sep.join([*steps, _entry(node, succ, digit)]) + f"\n!{node}{written}", f"{node}{total}", len(steps)


def _scatter(rng: random.Random, entries: list[str], filler: int) -> str:
    """``entries`` joined by commas with ``filler`` random :data:`FILLER` characters split into runs before,
    between (after each comma) and after them (uniform cut points); no rng draw when ``filler`` is 0."""
    if filler == 0:
        return ",".join(entries)
    cuts = sorted(rng.randint(0, filler) for _ in entries)
    runs = ["".join(rng.choices(FILLER, k=b - a)) for a, b in zip([0, *cuts], [*cuts, filler])]
    return runs[0] + ",".join(run + e for run, e in zip(["", *runs[1:-1]], entries)) + runs[-1]


def _recopy(rng: random.Random, entries: list[str]) -> list[str]:
    """Another order of the table's ``entries`` for a further copy: the first half of the list (rounded down)
    shuffled into the first half, the rest into the rest, so an entry's two copies are at least half a copy
    apart (a different KV page whenever half a copy's entries are longer than a page)."""
    half = len(entries) // 2
    first, rest = entries[:half], entries[half:]
    rng.shuffle(first)
    rng.shuffle(rest)
    return first + rest


def _entry(node: str, succ: dict[str, str], digit: dict[str, int]) -> str:
    """Table text of ``node``: node, successor in lower case, digit; or node and END."""
    return f"{node}{END}" if succ[node] == END else f"{node}{succ[node].lower()}{digit[node]}"


def _link(chain: list[str], succ: dict[str, str]) -> None:
    """Point each node of ``chain`` to the next one and the last one to END."""
    for k, nxt in zip(chain, [*chain[1:], END]):
        succ[k] = nxt


def solve(prompt: str) -> str:
    """Answer of a prompt (space-separated, one per query), computed from its text alone (an independent check
    of the generator).

    Raises ValueError when the prompt is not a well-formed chain problem (no table, unknown start, a cycle).
    """
    if "\n?" in prompt:  # the single-query format
        table_line, _, query = prompt.partition("\n?")
        starts = [query.strip()]
    else:
        head, _, query = prompt.partition(")\n")
        table_line, items = head + ")", query.strip().split(",")
        if not (len(items) >= 2 and items[-1][1:] == END and all(len(i) >= 2 for i in items)):
            raise ValueError(f"not a chain prompt: {prompt[:40]!r}...")
        starts = [item[1:].upper() for item in items[:-1]]
    if not (table_line.startswith("(") and table_line.endswith(")")) or not all(starts):
        raise ValueError(f"not a chain prompt: {prompt[:40]!r}...")
    entries = _entry_re(len(starts[0]), MAX_LETTERS).findall(table_line)
    table = {k: (int(d), n.upper()) if n else (0, END) for k, n, d in entries}
    return " ".join(_solve_walk(table, start) for start in starts)


def _solve_walk(table: dict[str, tuple[int, str]], node: str) -> str:
    """The answer of the walk from ``node`` through ``table`` (node -> (digit, successor or END))."""
    total, seen = 0, set()
    while True:
        if node not in table or node in seen:
            raise ValueError(f"chain prompt: node {node!r} is missing from the table or repeats")
        seen.add(node)
        d, nxt = table[node]
        if nxt == END:
            return f"{node}{total}"
        total = (total + d) % 10
        node = nxt


def parse_answers(completion: str) -> list[str]:
    """Every answer of ``completion`` in order: the text after each ``!`` up to whitespace."""
    return _ANSWER_RE.findall(completion)


def parse_answer(completion: str) -> str | None:
    """The last answer (:func:`parse_answers`), or None when there is no ``!``."""
    found = parse_answers(completion)
    return found[-1] if found else None


def parse_labelled_answers(completion: str) -> dict[str, str]:
    """label -> answer of every walk of ``completion`` (the label is the first character of the line before
    the ``!answer`` line; a label answered twice keeps its last answer)."""
    return dict(_LABELLED_ANSWER_RE.findall(completion))


@register_reward("chain")
def chain_reward(completion: str, answer: str, max_wrong: int = 0) -> float:
    """The fraction of the queries answered right (any text is accepted): ``answer`` holds the k reference
    answers, space-separated. In label order (``Q5 B8``) the completion's last k answers are compared with them
    in order, or, when it has fewer, its answers with the first ones; labelled (``À=Q5 Á=B8``, queries answered in
    any order) each query's answer is the one its label's walk gives. One query: 1.0 when the last answer is
    right, else 0.0.

    ``max_wrong`` (``task.max_wrong`` for the synthetic task, ``reward.options.max_wrong`` for a data file
    scored with ``reward.type=chain``) makes the task tolerant: a completion with at most that many
    queries wrong scores 1.0 (solved), one with more its fraction right; 0 = every query must be right."""
    if max_wrong < 0:
        raise ValueError(f"chain reward: max_wrong must be >= 0, got {max_wrong}")
    truth = answer.split(" ")
    if "=" in truth[0]:
        given = parse_labelled_answers(completion)
        right = sum(given.get(label) == value for label, _, value in (t.partition("=") for t in truth))
    else:
        right = sum(g == t for g, t in zip(parse_answers(completion)[-len(truth) :], truth))
    return 1.0 if len(truth) - right <= max_wrong else right / len(truth)


class ChainTask:
    """A seeded, indexable stream of chain problems.

    ``ramp_problems``: warm-start pairs grow from the smallest sizes to the full ranges over this many
    problems (:meth:`warm_start_pairs`); 0 = full ranges at once. ``late_ramp`` = (first, last): the
    filler and the number of queries instead stay at their minimum for the first ``first`` pairs and grow to
    their full ranges by pair ``last`` (None = with the sizes). ``problem(i)`` ignores both.
    """

    def __init__(
        self,
        config: ChainTaskConfig | None = None,
        ramp_problems: int = 0,
        late_ramp: tuple[int, int] | None = None,
    ) -> None:
        if ramp_problems < 0:
            raise ValueError(f"ChainTask: ramp_problems must be >= 0, got {ramp_problems}")
        if late_ramp is not None and not 0 <= late_ramp[0] <= late_ramp[1]:
            raise ValueError(
                f"ChainTask: late_ramp must be (first, last) with 0 <= first <= last, got {late_ramp}"
            )
        self.config = config or ChainTaskConfig()
        self.ramp_problems = ramp_problems
        self.late_ramp = late_ramp

    def problem(self, index: int, grown: float = 1.0, late_grown: float | None = None) -> ChainProblem:
        """Problem number ``index`` (deterministic in (config.seed, index, grown, late_grown)).

        ``grown`` in (0, 1] shrinks the size ranges toward their minimum, geometrically: the upper ends
        become ``min * (max / min) ** grown`` (rounded), the warm-start's ramp (it stays on small tables
        for a while, then grows faster). ``late_grown`` in [0, 1] (None = ``grown``) shrinks the upper ends of
        the filler and the number of queries linearly, ``min + (max - min) * late_grown`` (the filler's minimum
        may be 0). The filler length and the number of queries have their own random streams, so these knobs
        leave the table and the chains of problem ``index`` as they are.
        """
        cfg = self.config
        rng = random.Random(f"chain:{cfg.seed}:{index}")
        (n_lo, n_hi), (h_lo, h_hi) = cfg.num_nodes, cfg.num_hops
        num_nodes = rng.randint(n_lo, round(n_lo * (n_hi / n_lo) ** grown))
        hops_hi = round(h_lo * (h_hi / h_lo) ** grown)
        hops = (min(h_lo, num_nodes - 1), min(hops_hi, num_nodes - 1))
        late = grown if late_grown is None else late_grown
        filler = _late_size(f"filler:{cfg.seed}:{index}", cfg.filler_tokens, late)
        slips = random.Random(f"slips:{cfg.seed}:{index}")
        order = random.Random(f"order:{cfg.seed}:{index}")
        writing = Writing(
            cfg.name_length, cfg.letters, filler, cfg.slip_rate, slips, cfg.fact_copies, cfg.any_order, order
        )
        if cfg.multi_query:
            queries = min(_late_size(f"queries:{cfg.seed}:{index}", cfg.num_queries, late), num_nodes)
            return make_multi_problem(rng, num_nodes, hops, queries, writing)
        return make_problem(rng, num_nodes, rng.randint(*hops), writing)

    def problems(self, count: int, start: int = 0) -> list[ChainProblem]:
        """Problems ``start .. start + count - 1``."""
        return [self.problem(i) for i in range(start, start + count)]

    def warm_start_pairs(self, start: int = 0) -> Iterator[tuple[str, str]]:
        """Endless (prompt, reference trace) pairs for supervised warm-start, from index ``start`` on.

        With ``ramp_problems`` = R > 0 the n-th pair's sizes grow geometrically from the ranges'
        minimum to their full ranges over the first R pairs (a curriculum: a small model finds the
        table look-up on small tables, then carries it to long ones). ``late_ramp`` = (first, last): the
        n-th pair's filler and queries grow linearly from pair ``first`` to pair ``last`` (the look-up first,
        on short prompts and single walks; then the haystack or the many queries).
        """
        index, ramp = start, self.ramp_problems
        while True:
            n = index - start + 1
            late_grown = None
            if self.late_ramp is not None:
                first, last = self.late_ramp
                late_grown = 1.0 if n >= last else max(0.0, (n - first) / (last - first))
            p = self.problem(index, min(1.0, n / ramp) if ramp else 1.0, late_grown)
            yield p.prompt, p.trace
            index += 1

    def reward(self, completion: str, answer: str) -> float:
        """:func:`chain_reward` at the task's ``max_wrong``."""
        return chain_reward(completion, answer, self.config.max_wrong)


def _late_size(stream: str, bounds: tuple[int, ...], grown: float) -> int:
    """A size drawn uniformly from ``bounds`` = (min, max) with the upper end shrunk linearly to
    ``min + (max - min) * grown``, from its own random stream ``stream``."""
    lo, hi = bounds
    return random.Random(stream).randint(lo, lo + round((hi - lo) * grown))


def build_tasks(task: ChainTaskConfig, warmstart=None) -> tuple[ChainTask, ChainTask]:
    """(RL task, warm-start task) from the recipe's ``task`` section and, optionally, its ``warmstart``
    section, whose ``num_hops`` / ``num_nodes`` / ``filler_tokens`` / ``num_queries`` (when not null) give the
    warm-start problems other sizes, whose ``slip_rate`` gives its demonstrations mistakes, and whose ``ramp_steps`` (x ``batch_size`` problems) grows them from their
    minimum (the filler and the queries over ``late_ramp_steps`` when given).

    Raises the config's error (naming the sizes) when the warm-start's sizes do not make a valid task.
    """
    sizes = {
        key: tuple(value)
        for key in ("num_hops", "num_nodes", "filler_tokens", "num_queries")
        if (value := getattr(warmstart, key, None)) is not None
    }
    sizes["slip_rate"] = getattr(warmstart, "slip_rate", 0.0)
    ws = dataclasses.replace(task, **sizes)
    batch = getattr(warmstart, "batch_size", 1)
    ramp = getattr(warmstart, "ramp_steps", 0) * batch
    late = getattr(warmstart, "late_ramp_steps", None)
    late = None if late is None else (late[0] * batch, late[1] * batch)
    return ChainTask(task), ChainTask(ws, ramp_problems=ramp, late_ramp=late)
