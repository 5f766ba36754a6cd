"""Acquisition inputs: grouped prompts for generation trainers, a finite dataset for dataset trainers.

Generation (Flow-GRPO / Flow-Factory stage 2, "K-repeat sampling"): each rollout iteration draws
``prompts_per_iteration`` distinct prompts with a generator seeded by ``(seed, rollout_iteration)`` —
so the draw is a pure function of the counters and needs no saved sampler state — and repeats each
prompt ``group_size`` times, contiguously (Flow-Factory ``GroupContiguousSampler``): sample ``i`` belongs
to group ``i // group_size``. Across ranks the prompts, samples and group ids are global: rank r draws
the prompts ``r·P .. (r + 1)·P − 1`` of the iteration's one permutation, so its group ids start at r·P
and its samples at r·P·K (``repeat_groups(..., first_group=r·P)``); the ``AdvantageProcessor`` gathers
them and normalises each group over all its members.

Dataset (Flow-Factory Draft ``OfflineExecutionDriver``): ``torch.utils.data.DistributedSampler`` is
used even at one rank, with ``set_epoch(data_epoch)``; the loader is finite; a data epoch advances
only after clean exhaustion. ``gradient_accumulation_steps`` is explicit and the rank-local batch count
of an epoch must be a multiple of it — checked before training (``check_accumulation``), with no
implicit flush of a partial window. The sampler position saved in checkpoints is
``(data_epoch, batches consumed in that epoch)``; since the order depends only on ``(seed,
data_epoch)``, resuming replays the epoch's order and skips the consumed batches.

Only prompt conditions are cached (``ConditionCache``); images are loaded per batch and encoded on
demand by the trainer.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from reference_trainer.adapters.base import FIXTURES, BaseAdapter, Condition
from reference_trainer.config import DataConfig
from reference_trainer.errors import ConfigError

TINY_DATASET = FIXTURES / "tiny_dataset"
PROMPTS_FILE = FIXTURES / "prompts.txt"
IMAGES_FILE = "images.safetensors"


def default_prompts_file() -> Path:
    """The file of the packaged tiny prompt list, read wherever a prompt list is left empty."""
    return PROMPTS_FILE


def default_prompts() -> tuple[str, ...]:
    """The packaged tiny prompt list (``fixtures/prompts.txt``)."""
    lines = default_prompts_file().read_text().splitlines()
    return tuple(line.strip() for line in lines if line.strip())


class PromptSource:
    """Draws each rollout iteration's prompts; a pure function of ``(seed, rollout_iteration)``."""

    def __init__(self, prompts: Sequence[str], seed: int, *, rank: int = 0, world_size: int = 1):
        if not prompts:
            raise ConfigError("data.prompts", "no prompts to generate from")
        self.prompts = tuple(prompts)
        self.seed = seed
        self.rank, self.world_size = rank, world_size

    def draw(self, rollout_iteration: int, count: int) -> list[str]:
        """This rank's ``count`` prompts for ``rollout_iteration`` (distinct when enough prompts)."""
        total = count * self.world_size
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + rollout_iteration)
        order: list[int] = []
        while len(order) < total:
            order += torch.randperm(len(self.prompts), generator=generator).tolist()
        mine = order[self.rank * count : (self.rank + 1) * count]
        return [self.prompts[i] for i in mine]


def repeat_groups(
    prompts: Sequence[str], group_size: int, first_group: int = 0
) -> tuple[list[str], torch.Tensor]:
    """Repeat each prompt ``group_size`` times contiguously -> (prompts [P·K], group ids [P·K]).

    Group ids are global: ``first_group`` is the global index of this rank's first prompt (r·P)."""
    repeated = [prompt for prompt in prompts for _ in range(group_size)]
    group_ids = torch.arange(first_group, first_group + len(prompts)).repeat_interleave(group_size)
    return repeated, group_ids


class ConditionCache:
    """Prompt -> frozen text condition, computed once per prompt (the only thing ever cached)."""

    def __init__(self, adapter: BaseAdapter, together: bool = False):
        self.adapter = adapter
        self.together = together  # data.encode_prompts_together: each call's rows in one batch
        self._cache: dict[str, Condition] = {}

    def get(self, prompts: Sequence[str]) -> Condition:
        """Conditions for ``prompts`` in order, [len(prompts), ...]."""
        if self.together:  # one batch of every row, repeats included, uncached (a noise run)
            return self.adapter.encode_prompt(list(prompts))
        for prompt in dict.fromkeys(prompts):
            if prompt not in self._cache:
                # one prompt per call: a condition's bits must not depend on which other prompts
                # happened to be encoded with it (batch composition changes kernel blocking), or a
                # resumed run, whose cache starts empty, would drift from the uninterrupted one
                self._cache[prompt] = self.adapter.encode_prompt([prompt])
        return Condition.cat([self._cache[p] for p in prompts])


# --------------------------------------------------------------------------------------------------
# Dataset acquisition
# --------------------------------------------------------------------------------------------------


def dataset_directory(config: DataConfig) -> Path:
    """The directory of ``data.dataset`` (``tiny`` = the packaged one)."""
    if config.dataset is None:
        raise ConfigError("data.dataset", "a dataset trainer needs a dataset directory (or `tiny`)")
    return TINY_DATASET if config.dataset == "tiny" else Path(config.dataset)


def _record_path(config: DataConfig, supervision: str, split: str) -> Path:
    stem = {"demonstration": "demonstrations", "preference": "preferences"}[supervision]
    filename = {"train": f"{stem}.jsonl", "heldout": f"{stem}_heldout.jsonl"}[split]
    return dataset_directory(config) / filename


def _existing(path: Path, why: str = "") -> Path:
    if not path.is_file():
        raise ConfigError("data.dataset", f"{path} not found{why}")
    return path


def dataset_files(config: DataConfig, supervision: str) -> list[Path]:
    """The files of the dataset that records of ``supervision`` kind come from: the training records,
    the held-out records when the dataset has them, and the images (part of the run identity)."""
    heldout = _record_path(config, supervision, "heldout")
    return [
        _existing(_record_path(config, supervision, "train")),
        *([heldout] if heldout.is_file() else []),
        _existing(dataset_directory(config) / IMAGES_FILE),
    ]


def load_records(config: DataConfig, supervision: str, split: str = "train") -> list[dict[str, Any]]:
    """Records of ``supervision`` kind (``demonstration`` or ``preference``) with their image tensors.

    ``split``: ``train`` (``demonstrations.jsonl`` / ``preferences.jsonl``) or ``heldout``
    (``demonstrations_heldout.jsonl`` / ``preferences_heldout.jsonl``, for evaluation). Images are
    uint8 [3, H, W]; demonstration records get ``image``, preference records ``chosen`` and ``rejected``.
    """
    from safetensors.torch import load_file

    needed = " (eval.every > 0 needs held-out records)" if split == "heldout" else ""
    path = _existing(_record_path(config, supervision, split), needed)
    images = load_file(_existing(dataset_directory(config) / IMAGES_FILE))["images"]
    records = []
    for line in path.read_text().splitlines():
        raw = json.loads(line)
        record: dict[str, Any] = {"prompt": raw["prompt"]}
        for key in ("image", "chosen", "rejected"):
            if key in raw:
                record[key] = images[raw[key]]
        records.append(record)
    return records


def collate(records: list[dict[str, Any]]) -> dict[str, Any]:
    """List of records -> ``{"prompts": [B], "<image key>": uint8 [B, 3, H, W], ..., "indices": [B]}``.

    ``indices``: each record's position in the dataset (``DatasetAcquisition``), which seeds its draws,
    so that they do not depend on the rank that holds it; absent for records without one."""
    batch: dict[str, Any] = {"prompts": [record["prompt"] for record in records]}
    if all("index" in record for record in records):
        batch["indices"] = [record["index"] for record in records]
    for key in ("image", "chosen", "rejected"):
        if key in records[0]:
            batch[key] = torch.stack([record[key] for record in records])
    return batch


class DatasetAcquisition:
    """A finite, rank-sharded loader over ``records`` (``DistributedSampler`` even at one rank)."""

    def __init__(
        self,
        records: Sequence[dict[str, Any]],
        *,
        batch_size: int,
        seed: int,
        shuffle: bool,
        rank: int = 0,
        world_size: int = 1,
        source: str = "the dataset",
    ):
        self.records = [{**record, "index": index} for index, record in enumerate(records)]
        self.source = source
        """Where the records came from (named in messages)."""
        self.batch_size = batch_size
        self.sampler = DistributedSampler(
            self.records, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=False
        )

    @property
    def batches_per_epoch(self) -> int:
        """Rank-local batches per epoch (the last one may be smaller than ``batch_size``)."""
        return math.ceil(len(self.sampler) / self.batch_size)

    def batch_of(self, indices: Sequence[int]) -> dict[str, Any]:
        """The batch of the records at dataset positions ``indices`` (a target's sample ids, ``--inputs-from``)."""
        bad = [i for i in indices if not 0 <= i < len(self.records)]
        if bad:
            raise ConfigError(
                "--inputs-from",
                f"batch.sample_ids {bad} are no records of {self.source} ({len(self.records)} records); "
                "train the reference on the target's dataset",
            )
        return collate([self.records[i] for i in indices])

    def check_accumulation(self, gradient_accumulation_steps: int) -> None:
        """Config error unless every accumulation window of every epoch closes."""
        batches = self.batches_per_epoch
        if batches % gradient_accumulation_steps:
            raise ConfigError(
                "train.gradient_accumulation_steps",
                f"a rank-local epoch has {batches} batches ({len(self.records)} records, "
                f"{self.sampler.num_replicas} rank(s), data.batch_size={self.batch_size}), which is not a "
                f"multiple of gradient_accumulation_steps={gradient_accumulation_steps}: the last window "
                "would never close. Choose a divisor of the batch count or change data.batch_size",
            )

    def epoch(self, data_epoch: int, skip_batches: int = 0) -> Iterator[dict[str, Any]]:
        """The batches of ``data_epoch``, skipping the first ``skip_batches`` (resume)."""
        self.sampler.set_epoch(data_epoch)
        loader = DataLoader(
            self.records,
            batch_size=self.batch_size,
            sampler=self.sampler,
            collate_fn=collate,
            # its own generator: else each new iterator draws its base seed from the global torch RNG,
            # and a run resumed mid-epoch (one iterator more) would checkpoint another RNG state
            generator=torch.Generator().manual_seed(self.sampler.seed + data_epoch),
        )
        return itertools.islice(iter(loader), skip_batches, None)
