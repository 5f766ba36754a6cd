"""Hooks a model inherited from the model it was deep-copied from, and how install drops them.

`copy.deepcopy` of a module copies its hook dictionaries, and with them the functions `install`
registered on the original: they still write into the original's session under the original's
layer names. Installing on the copy would then add a second set, and every stage of the copy would
be captured twice (docs/dumping.md "Dumping your own runs"). `remember` notes, for each hook `install`
registers, the one hook dictionary it was registered in; `drop_inherited` removes from a model
every such hook that sits in another dictionary (a copy's), so installing on a copy installs once.
The original keeps its hooks.
"""

from __future__ import annotations

import weakref

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks")
_SIDE_DICTS = ("_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs")

_OWNER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""hook function -> weak reference to the hook dictionary `install` registered it in."""


def remember(hook) -> None:
    """Note the function behind a `RemovableHandle` and the dictionary that holds it."""
    ref = getattr(hook, "hooks_dict_ref", None)
    hooks = ref() if ref is not None else None
    if hooks is None:
        return
    fn = hooks.get(hook.id)
    if fn is not None:
        _OWNER[fn] = weakref.ref(hooks)


def drop_inherited(model) -> int:
    """Remove the ffdebug hooks `model` holds only because it was copied; returns how many."""
    dropped = 0
    for module in model.modules():
        for name in _HOOK_DICTS:
            hooks = getattr(module, name, None)
            if not hooks:
                continue
            for hook_id, fn in list(hooks.items()):
                try:
                    owner = _OWNER.get(fn)
                except TypeError:  # not weak-referenceable: never one of ours
                    continue
                if owner is None or owner() is hooks:
                    continue
                del hooks[hook_id]
                for side in _SIDE_DICTS:
                    getattr(module, side, {}).pop(hook_id, None)
                dropped += 1
    return dropped
