"""The embedded synthetic task: a character tokenizer and a verifiable multi-hop look-up problem."""

from sparrow_nemo.tasks.chain import (
    ChainProblem,
    ChainTask,
    ChainTaskConfig,
    build_tasks,
    chain_reward,
    parse_answer,
)
from sparrow_nemo.tasks.tokenizer import CharTokenizer

__all__ = [
    "ChainProblem",
    "ChainTask",
    "ChainTaskConfig",
    "CharTokenizer",
    "build_tasks",
    "chain_reward",
    "parse_answer",
]
