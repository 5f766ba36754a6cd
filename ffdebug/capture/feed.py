"""Feed blocks the reference's input: `FFDEBUG_FWD_FEED_DIR=<a reference side's dump>` replaces
the hidden-state input of every block whose `LNNN.hidden_in` that dump holds (first call, first
invocation) with the dumped tensor, before any capture hook sees it. The block's dumped stages
then show the error it makes itself on the reference's input: `ffdebug hunt`'s attribution round
(docs/hunt.md "ffdebug hunt", round 3), the command-line form of `ffdebug bisect --attribute`.
"""

from __future__ import annotations

import re

from ffdebug.arrays import to_torch
from ffdebug.errors import FFDebugError

_HIDDEN_IN = re.compile(r"^L(\d+)\.hidden_in$")


def reference_inputs(directory: str, rank: int) -> dict:
    """layer -> the record of its first `hidden_in` in `directory` (this rank's), with a payload."""
    from ffdebug.store.reader import open_side

    try:
        side = open_side(directory)
    except FFDebugError as err:
        raise FFDebugError(f"FFDEBUG_FWD_FEED_DIR: {err}") from None
    found: dict[int, object] = {}
    for r in side.records:
        m = _HIDDEN_IN.match(r.key)
        if m and r.rank == rank and r.invocation == 0 and (r.call or 0) == 0 and r.has_payload:
            found.setdefault(int(m.group(1)), r)
    if not found:
        raise FFDebugError(
            f"FFDEBUG_FWD_FEED_DIR={directory}: no L*.hidden_in record with a payload to feed; "
            "point it at a full dump (FFDEBUG_FWD_DUMP_MODE=full) of the blocks to replay"
        )
    return found


def _feeder(record, directory: str):
    """A forward pre-hook (with kwargs) substituting the block's hidden-state input once."""
    from ffdebug.capture.outputs import first_tensor

    done = []

    def pre(module, args, kwargs):
        if done:
            return None
        h = first_tensor(args, kwargs)
        if h is None:
            return None
        done.append(True)
        fed = to_torch(record.load()).to(dtype=h.dtype, device=h.device)
        if tuple(fed.shape) != tuple(h.shape):
            raise FFDebugError(
                f"FFDEBUG_FWD_FEED_DIR={directory}: {record.key} is {list(fed.shape)} there but the block "
                f"received {list(h.shape)}; feed a dump of the same inputs"
            )
        if "hidden_states" in kwargs:
            return args, dict(kwargs, hidden_states=fed)
        if any(a is h for a in args):
            return tuple(fed if a is h else a for a in args), kwargs
        key = next((k for k, v in kwargs.items() if v is h), None)
        if key is None:  # the input is nested (a tuple, a dict): not a hidden-state argument to swap
            raise FFDebugError(
                f"FFDEBUG_FWD_FEED_DIR={directory}: the block of {record.key} takes its hidden states "
                "inside another argument; pass them as the first argument or as hidden_states="
            )
        return args, dict(kwargs, **{key: fed})

    return pre


def hook_feed(handle, session, blocks) -> None:
    """Register the feeding pre-hooks first (`prepend`), so the dumped `hidden_in` is the fed one."""
    directory = session.config.feed_dir
    if not directory:
        return
    inputs = reference_inputs(directory, session.rank)
    for b in blocks:
        if b.layer in inputs:
            hook = _feeder(inputs[b.layer], directory)
            handle.add(b.module.register_forward_pre_hook(hook, with_kwargs=True, prepend=True))
