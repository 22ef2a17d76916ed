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
tokens back: the long-context miniature (``recipes/tiny_cpu.yaml``).

Why it suits sparse rollout: no node is visited twice, so each step's successor and digit (2 of its 6
characters) can only be read from the table in the prompt, far back, while the other characters are local
copies or a local sum. Dropping the right page hurts those few tokens badly while most stay easy (the skewed
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
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import re
import string
from collections.abc import Iterator
from dataclasses import dataclass

from sparrow_nemo.config.schema import AT_LEAST_ONE, NON_NEGATIVE, Section, interval, knob
from sparrow_nemo.rewards.registry import register_reward
from sparrow_nemo.tasks.tokenizer import MAX_LETTERS, alphabet

NODE_NAMES = string.ascii_uppercase
END = "."
#: haystack characters: in the tokenizer's CHARSET (one token each) and never in an entry, a trace or an answer
FILLER = ":;>+-*"
_ANSWER_RE = re.compile(r"!(\S*)")


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
    eos); ``answer`` is what :func:`parse_answer` must return for the completion to earn reward 1."""

    prompt: str
    trace: str
    answer: str
    num_nodes: int
    num_hops: int


@dataclass(frozen=True)
class ChainTaskConfig(Section):
    """Difficulty knobs (the recipe's ``task`` section); each problem draws its sizes uniformly from the
    inclusive ranges. With name length L the prompt has (2L + 2) * num_nodes + L + 4 - L * (number of chains)
    characters (plus the filler) and the trace (2L + 4) * (num_hops + 1). The tiny recipes use (2, 4) nodes,
    (1, 2) hops."""

    num_nodes: tuple[int, ...] = knob(
        (8, 26),
        "(min, max) table entries per problem (at most letters ** name_length: 26 with one-letter names)",
        check=interval(2, MAX_LETTERS**3),
    )
    num_hops: tuple[int, ...] = knob(
        (2, 25),
        "(min, max) pointer hops on the queried chain, clamped to num_nodes - 1 (2 * name_length + 4 response "
        "characters per hop)",
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
        "80 + 2 * (letters - 26) ids)",
        check=interval(26, MAX_LETTERS),
    )
    filler_tokens: tuple[int, ...] = knob(
        (0, 0),
        "(min, max) FILLER characters (one token each) scattered between the prompt table's entries: a haystack "
        "that makes the KV cache long while the look-ups stay as easy; (0, 0) = none (the original problems)",
        check=NON_NEGATIVE,
    )

    def check(self) -> None:
        for key in ("num_nodes", "num_hops", "filler_tokens"):
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


def make_problem(
    rng: random.Random,
    num_nodes: int,
    num_hops: int,
    name_length: int = 1,
    letters: int = 26,
    filler: int = 0,
) -> ChainProblem:
    """A problem with ``num_nodes`` table entries whose queried chain has ``num_hops`` hops (<= num_nodes - 1),
    nodes named by ``name_length`` of the first ``letters`` letters, and ``filler`` :data:`FILLER` characters
    scattered between the table's entries (drawn after everything else: the same problem, with a haystack)."""
    pool = NODE_NAMES if (name_length, letters) == (1, 26) else node_names(name_length, letters)
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
    entries = [_entry(k, succ, digit) for k in order]
    prompt = "(" + _scatter(rng, entries, filler) + f")\n?{path[0]}\n"
    steps, total = [], 0
    for k in path[:-1]:
        total = (total + digit[k]) % 10
        steps.append(f"{_entry(k, succ, digit)}={total}")
    answer = f"{path[-1]}{total}"
    trace = " ".join([*steps, _entry(path[-1], succ, digit)]) + f"\n!{answer}"
    return ChainProblem(prompt=prompt, trace=trace, answer=answer, num_nodes=num_nodes, num_hops=num_hops)


def _scatter(rng: random.Random, entries: list[str], filler: int) -> str:
    """``entries`` joined by commas with ``filler`` random :data:`FILLER` characters split into runs before,
    between (after each comma) and after them (uniform cut points); no rng draw when ``filler`` is 0."""
    if filler == 0:
        return ",".join(entries)
    cuts = sorted(rng.randint(0, filler) for _ in entries)
    runs = ["".join(rng.choices(FILLER, k=b - a)) for a, b in zip([0, *cuts], [*cuts, filler])]
    return runs[0] + ",".join(run + e for run, e in zip(["", *runs[1:-1]], entries)) + runs[-1]


def _entry(node: str, succ: dict[str, str], digit: dict[str, int]) -> str:
    """Table text of ``node``: node, successor in lower case, digit; or node and END."""
    return f"{node}{END}" if succ[node] == END else f"{node}{succ[node].lower()}{digit[node]}"


def _link(chain: list[str], succ: dict[str, str]) -> None:
    """Point each node of ``chain`` to the next one and the last one to END."""
    for k, nxt in zip(chain, [*chain[1:], END]):
        succ[k] = nxt


def solve(prompt: str) -> str:
    """Answer of a prompt, computed from its text alone (an independent check of the generator).

    Raises ValueError when the prompt is not a well-formed chain problem (no table, unknown start, a cycle).
    """
    table_line, _, query = prompt.partition("\n?")
    if not (table_line.startswith("(") and table_line.endswith(")")) or not query.strip():
        raise ValueError(f"not a chain prompt: {prompt[:40]!r}...")
    entries = _entry_re(len(query.strip()), MAX_LETTERS).findall(table_line)
    table = {k: (int(d), n.upper()) if n else (0, END) for k, n, d in entries}
    node, total, seen = query.strip(), 0, set()
    while True:
        if node not in table or node in seen:
            raise ValueError(f"chain prompt: node {node!r} is missing from the table or repeats")
        seen.add(node)
        d, nxt = table[node]
        if nxt == END:
            return f"{node}{total}"
        total = (total + d) % 10
        node = nxt


def parse_answer(completion: str) -> str | None:
    """The text after the last ``!`` up to whitespace, or None when there is no ``!``."""
    found = _ANSWER_RE.findall(completion)
    return found[-1] if found else None


@register_reward("chain")
def chain_reward(completion: str, answer: str) -> float:
    """1.0 when the completion's final answer equals ``answer`` exactly, else 0.0 (any text is accepted)."""
    return 1.0 if parse_answer(completion) == answer else 0.0


class ChainTask:
    """A seeded, indexable stream of chain problems.

    ``ramp_problems``: warm-start pairs grow from the smallest sizes to the full ranges over this many
    problems (:meth:`warm_start_pairs`); 0 = full ranges at once. ``filler_ramp`` = (first, last): the
    filler instead stays at its minimum for the first ``first`` pairs and grows to its full range by pair
    ``last`` (None = with the sizes). ``problem(i)`` ignores both.
    """

    def __init__(
        self,
        config: ChainTaskConfig | None = None,
        ramp_problems: int = 0,
        filler_ramp: tuple[int, int] | None = None,
    ) -> None:
        if ramp_problems < 0:
            raise ValueError(f"ChainTask: ramp_problems must be >= 0, got {ramp_problems}")
        if filler_ramp is not None and not 0 <= filler_ramp[0] <= filler_ramp[1]:
            raise ValueError(
                f"ChainTask: filler_ramp must be (first, last) with 0 <= first <= last, got {filler_ramp}"
            )
        self.config = config or ChainTaskConfig()
        self.ramp_problems = ramp_problems
        self.filler_ramp = filler_ramp

    def problem(self, index: int, grown: float = 1.0, filler_grown: float | None = None) -> ChainProblem:
        """Problem number ``index`` (deterministic in (config.seed, index, grown, filler_grown)).

        ``grown`` in (0, 1] shrinks the size ranges toward their minimum, geometrically: the upper ends
        become ``min * (max / min) ** grown`` (rounded), the warm-start's ramp (it stays on small tables
        for a while, then grows faster). ``filler_grown`` in [0, 1] (None = ``grown``) shrinks the filler's
        upper end linearly, ``min + (max - min) * filler_grown`` (its minimum may be 0). The filler length has its own random stream, so the filler knob leaves the
        table and the chain of problem ``index`` as they are.
        """
        cfg = self.config
        rng = random.Random(f"chain:{cfg.seed}:{index}")
        (n_lo, n_hi), (h_lo, h_hi), (f_lo, f_hi) = cfg.num_nodes, cfg.num_hops, cfg.filler_tokens
        num_nodes = rng.randint(n_lo, round(n_lo * (n_hi / n_lo) ** grown))
        hops_hi = round(h_lo * (h_hi / h_lo) ** grown)
        num_hops = rng.randint(min(h_lo, num_nodes - 1), min(hops_hi, num_nodes - 1))
        filler = random.Random(f"filler:{cfg.seed}:{index}").randint(
            f_lo, f_lo + round((f_hi - f_lo) * (grown if filler_grown is None else filler_grown))
        )
        return make_problem(rng, num_nodes, num_hops, cfg.name_length, cfg.letters, filler)

    def problems(self, count: int, start: int = 0) -> list[ChainProblem]:
        """Problems ``start .. start + count - 1``."""
        return [self.problem(i) for i in range(start, start + count)]

    def warm_start_pairs(self, start: int = 0) -> Iterator[tuple[str, str]]:
        """Endless (prompt, reference trace) pairs for supervised warm-start, from index ``start`` on.

        With ``ramp_problems`` = R > 0 the n-th pair's sizes grow geometrically from the ranges'
        minimum to their full ranges over the first R pairs (a curriculum: a small model finds the
        table look-up on small tables, then carries it to long ones). ``filler_ramp`` = (first, last): the
        n-th pair's filler grows linearly from pair ``first`` to pair ``last`` (the look-up first, on short
        prompts; then the haystack).
        """
        index, ramp = start, self.ramp_problems
        while True:
            n = index - start + 1
            filler_grown = None
            if self.filler_ramp is not None:
                first, last = self.filler_ramp
                filler_grown = 1.0 if n >= last else max(0.0, (n - first) / (last - first))
            p = self.problem(index, min(1.0, n / ramp) if ramp else 1.0, filler_grown)
            yield p.prompt, p.trace
            index += 1

    @staticmethod
    def reward(completion: str, answer: str) -> float:
        """See :func:`chain_reward`."""
        return chain_reward(completion, answer)


def build_tasks(task: ChainTaskConfig, warmstart=None) -> tuple[ChainTask, ChainTask]:
    """(RL task, warm-start task) from the recipe's ``task`` section and, optionally, its ``warmstart``
    section, whose ``num_hops`` / ``num_nodes`` / ``filler_tokens`` (when not null) give the warm-start problems other sizes and
    whose ``ramp_steps`` (x ``batch_size`` problems) grows them from their minimum (the filler over
    ``filler_ramp_steps`` when given).

    Raises the config's error (naming the sizes) when the warm-start's sizes do not make a valid task.
    """
    hops = getattr(warmstart, "num_hops", None)
    nodes = getattr(warmstart, "num_nodes", None)
    filler = getattr(warmstart, "filler_tokens", None)
    ws = dataclasses.replace(
        task,
        num_hops=tuple(hops) if hops is not None else task.num_hops,
        num_nodes=tuple(nodes) if nodes is not None else task.num_nodes,
        filler_tokens=tuple(filler) if filler is not None else task.filler_tokens,
    )
    batch = getattr(warmstart, "batch_size", 1)
    ramp = getattr(warmstart, "ramp_steps", 0) * batch
    filler_ramp = getattr(warmstart, "filler_ramp_steps", None)
    filler_ramp = None if filler_ramp is None else (filler_ramp[0] * batch, filler_ramp[1] * batch)
    return ChainTask(task), ChainTask(ws, ramp_problems=ramp, filler_ramp=filler_ramp)
