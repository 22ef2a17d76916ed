"""The chain task: generator vs an independent solver, lengths, long-range reads, reward robustness."""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
import statistics
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparrow_nemo.tasks.chain import (
    FILLER,
    ChainTask,
    ChainTaskConfig,
    build_tasks,
    chain_reward,
    make_problem,
    parse_answer,
    query_labels,
    solve,
)
from sparrow_nemo.tasks.tokenizer import CharTokenizer

TASK = ChainTask(ChainTaskConfig(seed=3))
PROBLEMS = TASK.problems(300)


def test_generator_answers_match_an_independent_solver() -> None:
    for p in PROBLEMS:
        assert solve(p.prompt) == p.answer
        assert chain_reward(p.trace, p.answer) == 1.0


def test_trace_replays_the_chain() -> None:
    """Every trace step copies a table entry and carries the running sum mod 10; no node repeats."""
    for p in PROBLEMS[:50]:
        entries = p.prompt[1 : p.prompt.index(")")].split(",")
        table = {e[0]: e[1:] for e in entries}
        assert len(table) == p.num_nodes
        *steps, last = p.trace.split("\n")[0].split(" ")
        assert len(steps) == p.num_hops
        total, nodes = 0, []
        for i, step in enumerate(steps):
            entry, running = step.split("=")
            assert table[entry[0]] == entry[1:]
            if i:
                assert entry[0] == steps[i - 1][1].upper()  # the previous step's successor
            total = (total + int(entry[2])) % 10
            assert int(running) == total
            nodes.append(entry[0])
        assert last == steps[-1][1].upper() + "." and table[last[0]] == "."
        nodes.append(last[0])
        assert len(set(nodes)) == len(nodes)
        assert p.answer == nodes[-1] + str(total)


def test_deterministic_and_seeded() -> None:
    again = ChainTask(ChainTaskConfig(seed=3)).problems(20)
    assert again == PROBLEMS[:20]
    other = ChainTask(ChainTaskConfig(seed=4)).problems(20)
    assert sum(a.prompt != b.prompt for a, b in zip(other, again)) >= 19


def test_sizes_follow_the_knobs() -> None:
    cfg = TASK.config
    for p in PROBLEMS:
        assert cfg.num_nodes[0] <= p.num_nodes <= cfg.num_nodes[1]
        assert cfg.num_hops[0] <= p.num_hops <= min(cfg.num_hops[1], p.num_nodes - 1)
        assert len(p.prompt) == 4 * p.num_nodes + 5 - p.prompt.count(".")
        assert len(p.trace) == 6 * p.num_hops + 6
    totals = [len(p.prompt) + len(p.trace) for p in PROBLEMS]
    assert min(totals) < 100 and max(totals) > 240  # varied lengths, several times a 64-token budget


def test_lookups_reach_far_back() -> None:
    """Each step's successor and digit exist only in the prompt table, each right after the only table
    occurrence of the token before it (plain induction); measure how far back they are."""
    tok = CharTokenizer()
    distances = []
    for p in PROBLEMS:
        text = p.prompt + p.trace
        assert len(tok.encode(text)) == len(text)  # one token per character
        table = p.prompt[: p.prompt.index(")")]
        for m in re.finditer(r"([A-Z])([a-z])(\d)=", p.trace):
            node, succ, digit = m.groups()
            assert table.count(node) == 1 and table.count(succ) == 1
            assert table[table.index(node) + 1] == succ and table[table.index(succ) + 1] == digit
            read_at = len(p.prompt) + m.start(2)  # position of the looked-up successor in the trace
            distances.append(read_at - (table.index(node) + 1))
    assert min(distances) >= 6
    assert statistics.median(distances) > 64  # beyond 4 pages of 16 tokens for half the look-ups


def test_warm_start_pairs() -> None:
    pairs = TASK.warm_start_pairs(start=5)
    for i in range(5, 10):
        assert next(pairs) == (PROBLEMS[i].prompt, PROBLEMS[i].trace)


def test_reward_parsing() -> None:
    p = PROBLEMS[0]
    wrong_digit = p.answer[0] + str((int(p.answer[1]) + 1) % 10)
    assert chain_reward(p.trace.replace(f"!{p.answer}", f"!{wrong_digit}"), p.answer) == 0.0
    assert chain_reward(f"!ZZ junk !{p.answer} trailing", p.answer) == 1.0  # the last ! counts
    assert chain_reward(f"!{p.answer}9", p.answer) == 0.0
    assert chain_reward("", p.answer) == 0.0
    assert parse_answer("no answer here") is None
    assert parse_answer("!") == ""


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_reward_is_total_on_garbage(text: str) -> None:
    assert chain_reward(text, "A1") in (0.0, 1.0)


def test_make_problem_extremes_and_errors() -> None:
    p = make_problem(random.Random(0), num_nodes=26, num_hops=25)
    assert solve(p.prompt) == p.answer and p.trace.count("=") == 25 and len(p.trace) == 156
    with pytest.raises(ValueError, match="num_hops"):
        make_problem(random.Random(0), num_nodes=5, num_hops=5)
    with pytest.raises(ValueError, match="num_nodes"):
        ChainTaskConfig(num_nodes=(2, 27))
    with pytest.raises(ValueError, match="num_hops"):
        ChainTaskConfig(num_nodes=(4, 6), num_hops=(7, 9))
    with pytest.raises(ValueError, match="not a chain prompt"):
        solve("hello")


# ----- two-letter names: the long-context miniature ------------------------------------------------
LONG = ChainTask(ChainTaskConfig(num_nodes=(40, 120), num_hops=(20, 110), seed=5, name_length=2))


def test_one_letter_problems_are_those_of_the_original_generator() -> None:
    """name_length=1 draws exactly what the single-letter generator drew (the recipes that keep it,
    e.g. tiny_cpu_distill, see the same problems): a digest of 500 problems of two configurations."""
    for cfg, digest in (
        (ChainTaskConfig(num_nodes=(2, 4), num_hops=(1, 2), seed=0), "1ca6641beeeaf350"),
        (ChainTaskConfig(seed=3), "e8bb4dddbd5538c2"),
    ):
        text = "".join(p.prompt + "|" + p.trace for p in ChainTask(cfg).problems(500))
        assert hashlib.sha256(text.encode()).hexdigest()[:16] == digest


def test_two_letter_chains_replay_the_table_and_match_the_solver() -> None:
    for p in LONG.problems(40):
        assert solve(p.prompt) == p.answer and chain_reward(p.trace, p.answer) == 1.0
        entries = p.prompt[1 : p.prompt.index(")")].split(",")
        table = {e[:2]: e[2:] for e in entries}
        assert len(table) == p.num_nodes == len(entries)
        *steps, last = p.trace.split("\n")[0].split(" ")
        assert len(steps) == p.num_hops and last.endswith(".")
        for i, step in enumerate(steps):
            entry = step.split("=")[0]
            assert table[entry[:2]] == entry[2:]
            if i:
                assert entry[:2] == steps[i - 1][2:4].upper()
        # lengths: 6 characters per table entry (4 for END entries, no comma after the last), 8 per hop
        assert len(p.prompt) == 6 * p.num_nodes + 6 - 2 * p.prompt.count(".")
        assert len(p.trace) == 8 * p.num_hops + 8


def test_two_letter_lookups_reach_hundreds_of_tokens_back() -> None:
    """A hop's successor sits right after the only table occurrence of its node's name, and the reads
    of a long chain's last hops lie more than 1,000 tokens behind."""
    far = []
    for p in LONG.problems(40):
        table = p.prompt[: p.prompt.index(")")]
        for m in re.finditer(r"([A-Z]{2})([a-z]{2})(\d)=", p.trace):
            node, succ, _ = m.groups()
            assert table.count(node) == 1 and table[table.index(node) + 2 : table.index(node) + 4] == succ
            far.append(len(p.prompt) + m.start(2) - table.index(node))
    assert statistics.median(far) > 300 and max(far) > 1000


def test_build_tasks_gives_the_warm_start_its_own_sizes() -> None:
    task_cfg = ChainTaskConfig(num_nodes=(40, 120), num_hops=(20, 110), seed=5, name_length=2, letters=26)
    ws = SimpleNamespace(num_hops=(4, 8), num_nodes=(10, 12), ramp_steps=3, batch_size=16)
    rl, warm = build_tasks(task_cfg, ws)
    assert rl.config == LONG.config
    assert (
        warm.config.num_hops == (4, 8) and warm.config.num_nodes == (10, 12) and warm.config.name_length == 2
    )
    assert all(4 <= p.num_hops <= 8 for p in warm.problems(30))
    assert (rl.ramp_problems, warm.ramp_problems) == (0, 48)  # ramp_steps x batch_size warm-start problems
    same, again = build_tasks(task_cfg, SimpleNamespace(num_hops=None, num_nodes=None))
    assert same.config == again.config == LONG.config
    with pytest.raises(ValueError, match="num_nodes"):
        build_tasks(task_cfg, SimpleNamespace(num_hops=(1, 2), num_nodes=(2, 700)))


def test_single_token_names_from_a_large_alphabet() -> None:
    """letters > 26: one-token names from non-ASCII letters too; the table lookups stay plain induction."""
    task = ChainTask(ChainTaskConfig(num_nodes=(100, 250), num_hops=(90, 240), seed=2, letters=260))
    tok = CharTokenizer(260)
    for p in task.problems(20):
        assert solve(p.prompt) == p.answer and chain_reward(p.trace, p.answer) == 1.0
        assert len(tok.encode(p.prompt + p.trace)) == len(p.prompt + p.trace)
        assert len(p.trace) == 6 * (p.num_hops + 1)
        table = p.prompt[: p.prompt.index(")")]
        for step in p.trace.split("\n")[0].split(" ")[:-1]:
            node, succ = step[0], step[1]
            assert table.count(node) == 1 and table[table.index(node) + 1] == succ
    with pytest.raises(ValueError, match="letters"):
        ChainTaskConfig(letters=10_000)


def test_warm_start_ramp_grows_sizes_from_the_minimum() -> None:
    """ramp_problems=R: the first pairs are the smallest tables, full ranges after R; RL problems unaffected."""
    cfg = ChainTaskConfig(num_nodes=(2, 60), num_hops=(1, 50), seed=1, name_length=2)
    task = ChainTask(cfg, ramp_problems=200)
    pairs = task.warm_start_pairs(start=1000)
    sizes = [solve(prompt) and prompt.count(",") + 1 for prompt, _ in (next(pairs) for _ in range(400))]
    assert max(sizes[:20]) <= round(2 * 30 ** (20 / 200)) and max(sizes[300:]) > 40
    assert statistics.mean(sizes[:100]) < statistics.mean(sizes[200:]) / 2
    assert task.problem(5) == ChainTask(cfg).problem(5)
    with pytest.raises(ValueError, match="ramp_problems"):
        ChainTask(cfg, ramp_problems=-1)


# ----- the haystack: filler between the table's entries --------------------------------------------
HAY = ChainTask(ChainTaskConfig(num_nodes=(22, 26), num_hops=(20, 25), seed=7, filler_tokens=(600, 1500)))


def _strip(text: str) -> str:
    return "".join(c for c in text if c not in FILLER)


def test_filler_never_meets_an_entry_a_trace_or_an_answer_and_is_one_token_each() -> None:
    tok = CharTokenizer()
    assert len(tok.encode(FILLER)) == len(FILLER) == len(set(FILLER))
    plain = ChainTask(dataclasses.replace(HAY.config, filler_tokens=(0, 0)))
    for i, p in enumerate(HAY.problems(40)):
        assert not set(FILLER) & set(p.trace + p.answer)
        table, query = p.prompt.split("\n?")
        assert not set(FILLER) & set(query)
        assert 600 <= sum(table.count(c) for c in FILLER) <= 1500
        assert len(tok.encode(p.prompt)) == len(p.prompt)
        # stripping the filler gives back the problem drawn without it: same table, chain and answer
        assert _strip(p.prompt) == plain.problem(i).prompt and p.trace == plain.problem(i).trace
        assert solve(p.prompt) == p.answer and chain_reward(p.trace, p.answer) == 1.0
        # no filler inside an entry: each hop's node and successor still have one table match each,
        # followed by the looked-up token
        for m in re.finditer(r"([A-Z])([a-z])(\d)=", p.trace):
            node, succ, digit = m.groups()
            assert table.count(node) == 1 and table[table.index(node) + 1] == succ
            assert table.count(succ) == 1 and table[table.index(succ) + 1] == digit


def test_filler_spreads_the_table_over_the_prompt() -> None:
    """The entries are scattered, not bunched: the table's entries span most of a long prompt."""
    spans = []
    for p in HAY.problems(40):
        where = [m.start() for m in re.finditer(r"[A-Z]", p.prompt.split("\n?")[0])]
        spans.append((where[-1] - where[0]) / len(p.prompt))
    assert statistics.median(spans) > 0.8


def test_no_filler_reproduces_the_original_problems_and_the_ramp_grows_it_linearly() -> None:
    base = ChainTaskConfig(num_nodes=(3, 26), num_hops=(1, 22), seed=0)
    assert base.filler_tokens == (0, 0)
    assert ChainTask(base).problems(50) == ChainTask(
        dataclasses.replace(base, filler_tokens=(0, 0))
    ).problems(50)
    ramped = ChainTask(dataclasses.replace(base, filler_tokens=(0, 1000)), ramp_problems=400)
    pairs = ramped.warm_start_pairs()
    filler = [sum(prompt.count(c) for c in FILLER) for prompt, _ in (next(pairs) for _ in range(800))]
    assert max(filler[:40]) <= 100 and max(filler[600:]) > 900  # grown/ramp: upper end 1000 * (n + 1) / 400
    assert statistics.mean(filler[:200]) < statistics.mean(filler[400:]) / 2
    _, warm = build_tasks(base, SimpleNamespace(num_hops=None, num_nodes=None, filler_tokens=(0, 64)))
    assert warm.config.filler_tokens == (0, 64)


def test_the_filler_can_have_its_own_ramp_after_the_look_up_phase() -> None:
    """warmstart.late_ramp_steps = (first, last): no filler for `first` steps (the problems of the filler-free
    task, pair for pair), then it grows linearly to its full range by step `last`."""
    base = ChainTaskConfig(num_nodes=(3, 26), num_hops=(1, 22), seed=0)
    ws = SimpleNamespace(
        num_hops=None,
        num_nodes=None,
        filler_tokens=(0, 1000),
        ramp_steps=5,
        batch_size=4,
        late_ramp_steps=(50, 100),
    )
    _, warm = build_tasks(base, ws)
    assert warm.late_ramp == (200, 400) and warm.ramp_problems == 20
    plain = build_tasks(
        base, SimpleNamespace(**{**vars(ws), "filler_tokens": None, "late_ramp_steps": None})
    )[1]
    pairs, plain_pairs = warm.warm_start_pairs(), plain.warm_start_pairs()
    got = [next(pairs) for _ in range(800)]
    assert got[:200] == [next(plain_pairs) for _ in range(200)]
    filler = [sum(prompt.count(c) for c in FILLER) for prompt, _ in got]
    assert max(filler[200:240]) <= 200 and max(filler[400:]) > 900
    with pytest.raises(ValueError, match="late_ramp"):
        ChainTask(base, late_ramp=(10, 5))
    with pytest.raises(ValueError, match="filler_tokens"):
        ChainTaskConfig(filler_tokens=(10, 5))
    with pytest.raises(ValueError, match="filler_tokens"):
        ChainTaskConfig(filler_tokens=(-1, 5))


def test_a_filler_ramp_of_no_length_is_a_config_error() -> None:
    from sparrow_nemo.config import ConfigError
    from sparrow_nemo.grpo.recipe import load_config

    with pytest.raises(ConfigError, match=r"warmstart\.late_ramp_steps.*first < last"):
        load_config("tiny_cpu_haystack", ["warmstart.late_ramp_steps=[5,5]"])


# ----- several labelled queries: the long-context miniature (recipes/tiny_cpu.yaml) -------------------
MULTI = ChainTask(ChainTaskConfig(num_nodes=(22, 26), num_hops=(12, 25), num_queries=(6, 20), seed=4))
_WALK = re.compile(r"([A-Z])([a-z])(\d)=(\d)")


def _walks(p) -> list[tuple[str, str]]:
    """(label, walk text up to its answer line) per query of a several-query trace."""
    return re.findall(r"(?:^|\n)(\S)(.*?\n![A-Z]\d)", p.trace, re.S)


def test_several_queries_replay_the_table_label_by_label() -> None:
    """Each walk: its label, the start copied from after that label in the prompt, steps ending in the label
    and a space, the chain's END, its answer; after the last walk the next label says END."""
    tok = CharTokenizer(ChainTaskConfig(num_queries=(6, 20)).tokenizer_letters)
    for p in MULTI.problems(60):
        assert solve(p.prompt) == p.answer and chain_reward(p.trace, p.answer) == 1.0
        assert len(tok.encode(p.prompt + p.trace)) == len(p.prompt + p.trace)  # one token per character
        table_text, queries = p.prompt.split(")\n")
        table = dict(re.findall(r"([A-Z])([a-z]\d|\.)", table_text))
        listed = queries.strip().split(",")
        assert len(listed) == p.num_queries + 1 and listed[-1][1:] == "."
        walks = _walks(p)
        assert [label for label, _ in walks] == [q[0] for q in listed[:-1]]
        assert p.trace.endswith("\n" + listed[-1])
        hops = 0
        for (label, walk), query, answer in zip(walks, listed, p.answer.split(" ")):
            assert walk[0] == query[1].upper()  # the start node, from after the label in the prompt
            steps = walk.split("\n")[0].split(f"{label} ")
            total = 0
            for i, step in enumerate(steps[:-1]):
                node, succ, digit, running = _WALK.fullmatch(step).groups()
                assert table[node] == succ + digit and (i == 0 or node == steps[i - 1][1].upper())
                total = (total + int(digit)) % 10
                assert int(running) == total
            assert table[steps[-1][0]] == "." and answer == f"{steps[-1][0]}{total}"
            hops += len(steps) - 1
        assert hops == p.num_hops


def test_several_queries_make_long_responses_from_short_prompts() -> None:
    """The miniature's geometry: ~140-token prompts, responses of hundreds to ~2,000 tokens."""
    prompts = [len(p.prompt) for p in MULTI.problems(300)]
    responses = sorted(len(p.trace) + 1 for p in MULTI.problems(300))
    assert max(prompts) < 200
    assert 500 < statistics.median(responses) < 1100 and responses[-1] < 2048 and responses[0] > 100


def test_the_reward_is_the_fraction_of_queries_answered_right_in_order() -> None:
    p = MULTI.problem(0)
    answers = p.answer.split(" ")
    k = len(answers)
    wrong = p.trace.replace(f"!{answers[1]}\n", f"!{answers[1][0]}{(int(answers[1][1]) + 1) % 10}\n", 1)
    assert chain_reward(wrong, p.answer) == (k - 1) / k
    cut = p.trace[: p.trace.index(f"!{answers[2]}") + 3]  # stopped after the third answer
    assert chain_reward(cut, p.answer) == 3 / k
    assert chain_reward("!" + " !".join(answers), p.answer) == 1.0
    assert chain_reward("!ZZ " + "!" + " !".join(answers), p.answer) == 1.0  # the last k answers count
    assert chain_reward("", p.answer) == 0.0


def test_labels_follow_the_node_alphabet_and_are_config_checked() -> None:
    from sparrow_nemo.tasks.chain import query_labels
    from sparrow_nemo.tasks.tokenizer import MAX_LETTERS, alphabet

    assert query_labels(26, 3) == alphabet(29)[26:] and not set(query_labels(26, 21)) & set(alphabet(26))
    cfg = ChainTaskConfig(num_queries=(6, 20))
    assert cfg.multi_query and cfg.tokenizer_letters == 26 + 21
    assert ChainTaskConfig().tokenizer_letters == 26 and not ChainTaskConfig().multi_query
    with pytest.raises(ValueError, match="num_queries"):
        ChainTaskConfig(letters=MAX_LETTERS - 5, num_queries=(1, 8))
    with pytest.raises(ValueError, match="num_queries"):
        ChainTaskConfig(num_queries=(5, 2))


def test_the_queries_grow_late_and_the_warm_start_shares_the_tokenizer() -> None:
    """late_ramp: one query (plus the closing label) until `first`, the full range by `last`; the table and
    chains of problem i do not depend on how many queries it has."""
    cfg = ChainTaskConfig(num_nodes=(22, 26), num_hops=(12, 25), num_queries=(1, 20), seed=1)
    pairs = ChainTask(cfg, late_ramp=(100, 200)).warm_start_pairs()
    counts = [prompt.split(")\n")[1].count(",") for prompt, _ in (next(pairs) for _ in range(300))]
    assert set(counts[:100]) == {1} and max(counts[200:]) > 15
    one, many = ChainTask(cfg).problem(7, late_grown=0.0), ChainTask(cfg).problem(7)
    assert one.prompt.split(")\n")[0] == many.prompt.split(")\n")[0] and one.num_queries == 1


def test_slipped_demonstrations_carry_on_from_their_mistakes() -> None:
    """slip_rate: a demonstration's written sum is wrong at that rate per hop and the trace continues from it;
    the problem (prompt, true answer) is the exact one; slip_rate 0 leaves every problem as it was."""
    cfg = dataclasses.replace(MULTI.config, slip_rate=0.05)
    exact, slipped = MULTI.problems(80), ChainTask(cfg).problems(80)
    assert [(p.prompt, p.answer) for p in exact] == [(p.prompt, p.answer) for p in slipped]
    rewards = [chain_reward(p.trace, p.answer) for p in slipped]
    assert statistics.mean(rewards) < 0.9 and max(rewards) == 1.0
    steps = slips = 0
    for p in slipped:
        for _, walk in _walks(p):
            written = 0
            for _, _, digit, running in _WALK.findall(walk):
                steps += 1
                slips += (
                    int(running) != (written + int(digit)) % 10
                )  # the sum carries on from what was written
                written = int(running)
            assert walk.endswith(str(written))  # the walk's answer line: its last written sum
    assert 0.03 < slips / steps < 0.07
    _, warm = build_tasks(MULTI.config, SimpleNamespace(slip_rate=0.05))
    assert warm.config.slip_rate == 0.05 and MULTI.config.slip_rate == 0.0


TOLERANT = ChainTask(dataclasses.replace(MULTI.config, fact_copies=2, any_order=True))


def test_a_second_copy_states_every_fact_again_half_a_copy_away() -> None:
    for index in range(40):
        p = TOLERANT.problem(index)
        first, second = re.match(r"\((.*?)\)\((.*?)\)\n", p.prompt).groups()
        assert sorted(first.split(",")) == sorted(second.split(","))  # the same facts, another order
        entries = first.split(",")
        start2 = len(first) + 2  # "(" + first + ")(": where the second copy's text begins, less one
        for e in entries:
            distance = start2 + second.index(e) - first.index(e)
            assert distance >= len(first) // 2 - len(e)
        assert solve(p.prompt) == " ".join(a.partition("=")[2] for a in p.answer.split(" "))
    assert any(
        re.match(r"\((.*?)\)", TOLERANT.problem(i).prompt).group(1)
        != re.match(r"\((.*?)\)\((.*?)\)", TOLERANT.problem(i).prompt).group(2)
        for i in range(5)
    )


def test_one_copy_in_label_order_is_the_task_as_it_was() -> None:
    same = ChainTask(dataclasses.replace(MULTI.config, fact_copies=1, any_order=False))
    assert [same.problem(i) for i in range(20)] == [MULTI.problem(i) for i in range(20)]
    tolerant = [TOLERANT.problem(i) for i in range(20)]
    assert [t.num_hops for t in tolerant] == [MULTI.problem(i).num_hops for i in range(20)]  # same graphs


def test_any_order_walks_are_a_fork_and_the_reward_reads_them_by_label() -> None:
    in_label_order = []
    for index in range(30):
        p = TOLERANT.problem(index)
        labels = [line[0] for line in p.trace.split("\n")[::2][:-1]]
        assert sorted(labels) == [a[0] for a in p.answer.split(" ")]  # every query once, labelled answers
        in_label_order.append(labels == sorted(labels))
        assert chain_reward(p.trace, p.answer) == 1.0
        assert p.trace.endswith(f"{query_labels(26, p.num_queries + 1)[-1]}.")
    assert sum(in_label_order) <= 3  # a random order (6-20 queries: label order is rare)
    p = next(TOLERANT.problem(i) for i in range(30) if TOLERANT.problem(i).num_queries >= 4)
    lines = p.trace.split("\n")
    walks, end, k = [list(pair) for pair in zip(lines[0:-1:2], lines[1::2])], lines[-1], p.num_queries

    def text(pairs: list[list[str]]) -> str:
        return "\n".join([*(line for pair in pairs for line in pair), end])

    def miss(pair: list[str]) -> list[str]:  # the walk's answer with its sum off by one
        return [pair[0], pair[1][:-1] + str((int(pair[1][-1]) + 1) % 10)]

    assert chain_reward(text(walks[::-1]), p.answer) == 1.0  # any order is right
    one_wrong, dropped = text([miss(walks[0]), *walks[1:]]), text(walks[1:])
    assert chain_reward(one_wrong, p.answer) == chain_reward(dropped, p.answer) == (k - 1) / k
    assert (
        chain_reward(one_wrong, p.answer, max_wrong=1) == 1.0
    )  # the tolerant setting: one miss still solves it
    two_wrong = text([miss(walks[0]), miss(walks[1]), *walks[2:]])
    assert chain_reward(two_wrong, p.answer, max_wrong=1) == (k - 2) / k
    assert chain_reward("!" + " !".join(a.partition("=")[2] for a in p.answer.split(" ")), p.answer) == 0.0
    with pytest.raises(ValueError, match="max_wrong"):
        chain_reward(p.trace, p.answer, max_wrong=-1)


def test_any_order_needs_several_queries_and_labels_parse_in_linear_time() -> None:
    with pytest.raises(ValueError, match="any_order"):
        ChainTaskConfig(any_order=True).check()
    hostile = "À" + "x" * 200_000 + "\n" * 200_000 + "!" * 200_000
    assert chain_reward(hostile, "À=Q5 Á=B8") == 0.0


def test_the_tolerant_recipe_binds_its_knobs_and_its_prompts_fit() -> None:
    from sparrow_nemo.grpo.prompts import build_prompt_source
    from sparrow_nemo.grpo.recipe import load_config

    config = load_config("tiny_cpu_tolerant", [])
    rl, warm = build_tasks(config.task, config.warmstart)
    assert (
        warm.config.fact_copies == 2 and warm.config.any_order
    )  # the warm-start writes problems the same way
    problems = rl.problems(100)
    assert (
        max(len(p.prompt) + 1 for p in problems) <= config.data.max_prompt_tokens
    )  # one token per character
    assert rl.config.max_wrong == 2
    build_prompt_source(config)  # the run's prompt source accepts the recipe (no reward.options on the task)
    reward = rl.reward  # what a run scores with (task.max_wrong)
    p = next(p for p in problems if p.num_queries >= 6)
    lines = p.trace.split("\n")
    off = {1, 3}  # two answer lines off by one: still solved at max_wrong 2
    broken = [line[:-1] + str((int(line[-1]) + 1) % 10) if i in off else line for i, line in enumerate(lines)]
    assert reward("\n".join(broken), p.answer) == 1.0 and chain_reward("\n".join(broken), p.answer) < 1.0
