"""Every attack of ``attacks/`` against the sandbox, with the trainer as root (or as whoever runs the suite)
and, where the machine allows it, as an unprivileged user: reward 0, no process left, nothing written
outside, the victim alive, no connection made."""

from __future__ import annotations

import os
import pwd

import pytest

from sparrow_nemo.rewards.code import code_reward

from ._hostile import (
    ADD_SPECS,
    HONEST,
    HONEST_STDIO,
    STDIO_SPEC,
    Targets,
    UserTrainer,
    attack,
    attack_names,
    honest,
)

#: the attacks whose point is the verdict: they also run against the assert-list format
VERDICT_ATTACKS = [
    "eq_always_true",
    "subclass_eq",
    "settrace_skip_asserts",
    "frame_walk_for_secrets",
    "early_exit",
    "sys_exit_in_call",
    "forge_replies",
    "override_builtins",
    "deep_and_huge_values",
    "resolve_extra_names",
    "malformed_resolve_reply",
    "malformed_call_reply",
    "hash_collision_set",
]
CASES = [(n, "humaneval") for n in attack_names()] + [(n, "asserts") for n in VERDICT_ATTACKS]


@pytest.fixture(scope="module")
def targets() -> Targets:
    t = Targets(os.geteuid())
    yield t
    t.close()


def test_honest_programs_pass_so_a_zero_means_something(sandbox: None, targets: Targets) -> None:
    for spec in ADD_SPECS.values():
        assert code_reward(HONEST, honest(spec)) == 1.0
    assert code_reward(HONEST_STDIO, honest(STDIO_SPEC)) == 1.0
    assert targets.damage() == []


@pytest.mark.parametrize(("name", "fmt"), CASES, ids=[f"{n}-{f}" for n, f in CASES])
def test_attack_as_the_trainer_user(
    sandbox: None, targets: Targets, monkeypatch: pytest.MonkeyPatch, name: str, fmt: str
) -> None:
    monkeypatch.setenv("SPARROW_TEST_SECRET", targets.secret)
    result = attack(targets, name, fmt)
    assert result["reward"] == 0.0 and result["damage"] == [], result


@pytest.fixture(scope="module")
def user_trainer() -> UserTrainer:
    if os.geteuid() != 0:
        pytest.skip("the suite runs as an unprivileged user already (the test above covers it)")
    nobody = pwd.getpwnam("nobody").pw_uid
    t = Targets(nobody)
    trainer = UserTrainer(nobody, t)
    yield trainer
    trainer.close()
    t.close()


def test_unprivileged_trainer_has_the_sandbox_or_refuses(user_trainer: UserTrainer) -> None:
    """As nobody, bwrap needs unprivileged user namespaces; without them the reward must refuse."""
    iso = user_trainer.isolation
    assert iso["euid"] != 0
    if not iso["available"]:
        assert "user namespaces" in iso["missing"]
        result = user_trainer.attack("write_outside", "humaneval")
        assert "SandboxUnavailable" in result["error"] and result["damage"] == []


@pytest.mark.parametrize(("name", "fmt"), CASES, ids=[f"{n}-{f}" for n, f in CASES])
def test_attack_as_an_unprivileged_trainer(user_trainer: UserTrainer, name: str, fmt: str) -> None:
    if not user_trainer.isolation["available"]:
        pytest.skip(f"no sandbox for an unprivileged user here: {user_trainer.isolation['missing']}")
    result = user_trainer.attack(name, fmt)
    assert result.get("reward") == 0.0 and result["damage"] == [], result
