"""Verifiable rewards: math answers, sandboxed code tests, and the synthetic chain task (see registry)."""

from sparrow_nemo.rewards.registry import bind_reward, get_reward, register_reward, reward_names

__all__ = ["bind_reward", "get_reward", "register_reward", "reward_names"]
