"""GRPO algorithm pieces: group advantages, policy losses with rollout/train mismatch correction, prompt data.

Modules are imported on demand (``from sparrow_nemo.grpo.losses import ...``) so that the light pieces do not
pull in the heavier ones.
"""
