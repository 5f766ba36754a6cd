"""Playbooks as data and automated review checks (no torch).

- `playbooks`: load / validate / render the YAML playbooks in `playbooks/`;
- `triage`: the quick-start decision tree stored in `playbooks/dump-bisect.yaml`;
- `checks`: the AST-based checks, each registered under a stable id;
- `runner`: file collection (`--diff BASE`), configuration, and the review report.
"""
