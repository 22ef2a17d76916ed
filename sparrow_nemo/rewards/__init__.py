"""Verifiable rewards: math answers, sandboxed code tests, and the synthetic chain task (see registry)."""

from sparrow_nemo.rewards.registry import get_reward, register_reward, reward_names

__all__ = ["get_reward", "register_reward", "reward_names"]
