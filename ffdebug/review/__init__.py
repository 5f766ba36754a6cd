"""Playbooks as data and automated review checks (no torch).

- `playbooks`: load / validate / render the YAML playbooks in `playbooks/`;
- `triage`: the quick-start decision tree stored in `playbooks/dump-bisect.yaml`;
- `checks`: the registry of checks under stable ids, and the component / data-order / license checks;
  `numeric_checks`, `trainer_checks` (with `classes`, the cross-file class index): the other domain
  checks; `lint_checks`: the generic checks, found by ruff and bandit (`tools` runs them);
- `runner`: file collection (`--diff BASE`), configuration, and the review report.
"""
