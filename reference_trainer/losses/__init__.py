"""Loss functions: pure functions of tensors returning ``(loss, metrics)``, one algorithm per module.

``grpo`` (Flow-GRPO PPO clip + KL), ``grpo_guard`` (GRPO's clip on the normalised log-ratio), ``dppo``
(Flow-DPPO trust-region mask; it also returns the mask), ``dpo`` (Diffusion-DPO, velocity form), ``sft`` (flow-matching
velocity MSE), ``dmd2`` (distribution-matching generator loss and fake-score loss), ``tdm`` (conditional re-noise,
importance-weighted fake-score loss, revised-x̂_0 generator loss), ``opd`` (on-policy distillation's
per-step Gaussian KL to the teachers).
"""
