"""The dump store (docs/dumping.md "The dump store"): `<dir>/<side>/run.json` + `rankNNN/manifest.jsonl` + safetensors payloads.

The manifest is the only source of truth; readers never parse file names.
"""

from ffdebug.store.reader import Record, SideStore, open_side
from ffdebug.store.schema import FORMAT_VERSION, RECORD_KEYS

__all__ = ["FORMAT_VERSION", "RECORD_KEYS", "Record", "SideStore", "open_side"]
