"""Rollout tools: the rollout benchmark (``sparrow bench rollout``) and the decode cost model's fit to this machine."""
