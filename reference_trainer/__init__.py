"""A small, complete, CPU-runnable reference trainer for diffusion / flow-matching RL finetuning.

Layers, imports pointing down only (docs/architecture.md):

1. ``errors`` (``ConfigError``, ``require``), ``contracts`` (``ExecutionContract``), ``registry``
   (trainers with their TrainingArguments, adapters), ``config`` (YAML -> frozen dataclasses;
   parts ``config_schema``, ``config_parse``, ``config_load``);
2. ``adapters/`` (tiny SD3 and Flux), ``sde`` / ``flow_matching`` (sampling maths), ``data``
   (grouped prompts, ``DistributedSampler`` datasets), ``rewards`` / ``advantages`` / ``feedback``
   (runtime-reward scoring of generation trainers), ``roles``
   (variants vs snapshots), ``optim`` (``CompositeOptimizer``, role phases), ``checkpoint``
   (parts ``checkpoint_format``, ``checkpoint_identity``, ``checkpoint_validate``, ``checkpoint_resume``);
3. ``trainers/base.py`` (``BaseTrainer``: the loop, counters, boundaries, resume; its parts in
   ``trainers/boundaries.py``, ``progress.py``, ``run_files.py``, ``role_setup.py``, ``identity.py``);
4. ``trainers/<algorithm>.py``: one algorithm per file (arguments + trainer), on ``losses/``;
5. ``run`` (build a run from a config) and ``cli`` (``reference-trainer``).

Run: ``reference-trainer train examples/grpo/full/sd3_tiny/default.yaml --output-dir runs/grpo``
(or ``python -m reference_trainer train ...``). Importing this package imports nothing heavy.
"""
