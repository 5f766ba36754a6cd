"""``python -m reference_trainer`` = the ``reference-trainer`` command."""

from reference_trainer.cli import main

main()
