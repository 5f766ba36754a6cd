"""`python -m ffdebug …`: the CLI, also as torchrun runs it (`torchrun … -m ffdebug compare REF
TARGET`: a compare across nodes, docs/across-nodes.md)."""

from ffdebug.cli.app import main

if __name__ == "__main__":
    main()
