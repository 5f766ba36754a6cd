"""The tensor-file layer: every kind of input (store payloads, tensor files, checkpoints, foreign
dumps) read as typed `Record`s with lazy sources. See docs/architecture.md."""
