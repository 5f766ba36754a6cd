"""Loss functions: pure functions of tensors returning ``(loss, metrics)``, one algorithm per module.

``grpo`` (Flow-GRPO PPO clip + KL), ``dpo`` (Diffusion-DPO, velocity form), ``sft`` (flow-matching
velocity MSE), ``dmd2`` (distribution-matching generator loss and fake-score loss).
"""
