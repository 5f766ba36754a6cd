"""Teacher forcing through the reference: take a target run's inputs from its ffdebug store.

``reference-trainer train CONFIG --inputs-from STORE`` (docs/trainer-taps.md "Compare your own trainer") makes
the reference consume, for each rollout iteration, the inputs the target's store recorded under the
tap contract's names (docs/trainer-taps.md) instead of drawing its own:

* ``rollout.prompt_ids`` [B, L]: each row is looked up among the config's ``data.prompts`` tokenized
  by the adapter; rows must come in contiguous groups of ``group_size`` equal prompts;
* ``rollout.noise`` [B, C, H, W] and ``rollout.sde_noise`` [B, T, C, H, W]: every Gaussian draw of
  the rollout;
* ``train.order`` [B]: the order the iteration's samples are trained in (its minibatches);
* every other random draw a trainer makes through ``BaseTrainer.drawn`` (a dataset batch's
  ``batch.sample_ids``, ``train.sigma``, ``train.noise``, ``train.timestep_index``, …): the target's
  value of that stage *with the same step tags* (the k-th such capture for the k-th draw).

Only draws are taken. What the configuration fixes (the σ schedule ``rollout.timesteps``, a dataset
record's prompt token ids) the reference recomputes from its own configuration and taps with
``derived_from``, so that compare's same-inputs gate names a target configured otherwise (exit 3)
instead of the reference silently running the target's schedule.

So a trainer written from scratch, with its own RNG, is compared stage by stage without copying the
reference's seeding. An input the store lacks is drawn by the reference as usual and listed as *not
taken*; ``DIR/inputs_from.json`` and one stderr line say what was taken, what was recomputed and
what was drawn (the coverage of the forcing). The target's stage names may differ: ``--inputs-map OLD=NEW`` (or
``--inputs-map-file FILE``, compare's ``--alias-file`` format) renames them with ffdebug's stage map
before the lookup.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ffdebug.arrays import to_torch
from reference_trainer.adapters.base import SamplingInputs
from reference_trainer.errors import ConfigError
from reference_trainer.taps import INPUT_STAGES

INPUTS_FILE = "inputs_from.json"
TagKey = tuple[tuple[tuple[str, Any], ...], Any]


def tag_key(step: Mapping[str, Any], phase: Any) -> TagKey:
    """A capture's step tags and phase as a lookup key (tag order does not matter)."""
    return tuple(sorted((str(k), v) for k, v in step.items())), phase


def _tags_text(tags: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in tags.items()) or "no tags"


class InputsFrom:
    """The inputs of a target's store, by (stage, rollout_iteration), for one rank (module docstring)."""

    def __init__(
        self,
        store: str | Path,
        *,
        rank: int = 0,
        maps: Sequence[str] = (),
        map_file: str | Path | None = None,
    ) -> None:
        from ffdebug.capture.stage_map import StageMap
        from ffdebug.errors import FFDebugError
        from ffdebug.store.reader import open_side

        self.store = str(store)
        try:
            side = open_side(self.store)
            stage_map = StageMap.of(list(maps), str(map_file) if map_file else None)
        except FFDebugError as error:
            raise ConfigError("--inputs-from", str(error)) from None
        self._records: dict[tuple[str, int], Any] = {}
        self._tagged: dict[tuple[str, TagKey], list[Any]] = {}
        for rec in side.records:
            key = stage_map.apply(rec.key)
            if key not in INPUT_STAGES or rec.rank != rank:
                continue
            self._tagged.setdefault((key, tag_key(rec.step, rec.phase)), []).append(rec)
            iteration = rec.step.get("rollout_iteration")
            if isinstance(iteration, int):
                self._records.setdefault((key, iteration), rec)
        if not self._tagged:
            raise ConfigError(
                "--inputs-from",
                f"{self.store} holds none of {', '.join(INPUT_STAGES)} on rank {rank}; tap the target's inputs "
                "as docs/trainer-taps.md says (or rename them with --inputs-map)",
            )
        self._drawn: dict[tuple[str, TagKey], int] = {}
        self.taken: dict[str, list[int]] = {key: [] for key in INPUT_STAGES}
        self.not_taken: dict[str, list[int]] = {key: [] for key in INPUT_STAGES}
        self.recomputed: dict[str, list[int]] = {}

    def _get(self, key: str, iteration: int) -> torch.Tensor | None:
        rec = self._records.get((key, iteration))
        (self.taken if rec is not None else self.not_taken)[key].append(iteration)
        return None if rec is None else to_torch(rec.load())

    def take(
        self,
        key: str,
        tags: Mapping[str, Any],
        drawn: torch.Tensor,
        *,
        within: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """The target's value of the draw ``key`` captured under ``tags`` (the k-th such capture for
        the k-th call), else ``drawn`` (listed as not taken). Its shape must be ``drawn``'s: a draw of
        another size is a target that does not follow the contract; ``within=(low, high)``: an index
        draw's range, low ≤ i < high."""
        step = {k: v for k, v in tags.items() if k != "phase"}
        where = (key, tag_key(step, tags.get("phase")))
        count = self._drawn.get(where, 0)
        self._drawn[where] = count + 1
        iteration = int(tags.get("rollout_iteration", 0))
        recs = self._tagged.get(where, [])
        if count >= len(recs):
            self.not_taken[key].append(iteration)
            return drawn
        given = to_torch(recs[count].load())
        if tuple(given.shape) != tuple(drawn.shape):
            raise ConfigError(
                "--inputs-from",
                f"{self.store}: {key} at {_tags_text(tags)} has shape {list(given.shape)}, the reference draws "
                f"{list(drawn.shape)} there; the target's draw does not follow docs/trainer-taps.md",
            )
        if within is not None and not bool(((given >= within[0]) & (given < within[1])).all()):
            raise ConfigError(
                "--inputs-from",
                f"{self.store}: {key} at {_tags_text(tags)} is {given.tolist()}, outside {within[0]} .. "
                f"{within[1] - 1}; the target's run is configured otherwise (step counts) or does not "
                "follow docs/trainer-taps.md",
            )
        self.taken[key].append(iteration)
        return given.to(drawn.dtype)

    def recompute(self, key: str, iteration: int) -> None:
        """Record that ``key`` was recomputed from the reference's configuration, not taken."""
        self.recomputed.setdefault(key, []).append(iteration)

    def prompts(
        self,
        iteration: int,
        group_size: int,
        known: Sequence[str],
        token_ids: Callable[[list[str]], torch.Tensor],
    ) -> list[str] | None:
        """The iteration's P distinct prompts (one per group of ``group_size`` rows), or None.

        ``token_ids(prompts) -> [n, L]`` tokenizes as the adapter does; ``known``: the config's prompts.
        """
        ids = self._get("rollout.prompt_ids", iteration)
        if ids is None:
            return None
        where = f"{self.store}: rollout.prompt_ids of rollout_iteration {iteration}"
        rows = self.prompts_of(ids, known, token_ids, where)
        if len(rows) % group_size:
            raise ConfigError("--inputs-from", f"{where}: {len(rows)} rows are not groups of {group_size}")
        groups = [rows[i : i + group_size] for i in range(0, len(rows), group_size)]
        for index, group in enumerate(groups):
            if len(set(group)) != 1:
                raise ConfigError(
                    "--inputs-from",
                    f"{where}: group {index} (rows {index * group_size}-{(index + 1) * group_size - 1}) mixes "
                    "prompts; a group is train.group_size contiguous samples of one prompt",
                )
        return [group[0] for group in groups]

    def prompts_of(
        self,
        ids: torch.Tensor,
        known: Sequence[str],
        token_ids: Callable[[list[str]], torch.Tensor],
        where: str,
    ) -> list[str]:
        """The prompt of each row of token ids [n, L], looked up among ``known`` tokenized as the adapter does."""
        table = {tuple(row.tolist()): prompt for row, prompt in zip(token_ids(list(known)), known)}
        rows = [table.get(tuple(row.tolist())) for row in ids.long()]
        if None in rows:
            raise ConfigError(
                "--inputs-from",
                f"{where}, row {rows.index(None)}, is no prompt of data.prompts; train the reference on the "
                "target's prompt list",
            )
        return rows  # type: ignore[return-value]

    def sampling(self, iteration: int, noise_level: float, sigmas: torch.Tensor) -> SamplingInputs | None:
        """The iteration's noise with the reference's own schedule ``sigmas`` (recomputed, never taken:
        the gate compares it with the target's), or None when the store lacks the noise."""
        self.recompute("rollout.timesteps", iteration)
        noise = self._get("rollout.noise", iteration)
        sde_noise = self._get("rollout.sde_noise", iteration) if noise_level > 0 else None
        if noise is None or (noise_level > 0 and sde_noise is None):
            return None
        return SamplingInputs(sigmas=sigmas.float(), noise=noise.float(), sde_noise=sde_noise)

    def order(self, iteration: int, batch: int) -> torch.Tensor | None:
        """The iteration's training order [B] (a permutation of 0..B−1), or None."""
        order = self._get("train.order", iteration)
        if order is None:
            return None
        order = order.long().flatten()
        if sorted(order.tolist()) != list(range(batch)):
            raise ConfigError(
                "--inputs-from",
                f"{self.store}: train.order of rollout_iteration {iteration} is not a permutation of the {batch} samples",
            )
        return order

    def report(self) -> dict[str, Any]:
        """What was taken from the store and what the reference drew itself, per input and iteration."""
        return {
            "store": self.store,
            "taken": {key: sorted(set(its)) for key, its in self.taken.items() if its},
            "recomputed": {key: sorted(set(its)) for key, its in self.recomputed.items()},
            "not_taken": {key: sorted(set(its)) for key, its in self.not_taken.items() if its},
        }

    def finish(self, output_dir: Path) -> None:
        """Write ``inputs_from.json`` (atomically) and say on stderr what was taken."""
        report = self.report()
        path = Path(output_dir) / INPUTS_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        tmp.replace(path)
        taken = ", ".join(f"{key} ×{len(its)}" for key, its in self.taken.items() if its) or "nothing"
        line = f"inputs from {self.store}: took {taken}"
        if report["recomputed"]:
            line += "; recomputed from its own config " + ", ".join(report["recomputed"])
        if report["not_taken"]:
            line += "; drew its own " + ", ".join(
                f"{k} (iterations {v})" for k, v in report["not_taken"].items()
            )
        print(line, file=sys.stderr)
