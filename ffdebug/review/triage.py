"""The quick-start decision tree (`ffdebug playbook triage`): questions in, phase and commands out.

The tree is data, in `playbooks/dump-bisect.yaml` under `triage:`::

    triage:
      start: symptom                      # the first question
      questions:
        symptom:                          # a choice question: --symptom VALUE
          ask: What are you looking at?
          choices: {crash: local-breach, wrong-output: deterministic}
        deterministic:                    # a yes/no question: --deterministic / --no-deterministic
          ask: Same input, same output, run after run?
          flag: deterministic             # optional; defaults to the question id (several may share one)
          yes: batch-only                 # next question or outcome
          no: broken-determinism
          default: no                     # optional: the answer assumed when none is given
      outcomes:
        weights:
          playbook: dump-bisect
          phase: 1                        # or section: <section id>
          say: Rule out weight loading before any forward bisect.
          commands: [...]                 # optional; default: the commands of the section's items

Answers come from flags; a question without an answer is asked (interactive) or, when it has a
`default`, assumed and reported as assumed; otherwise it is an error naming the flag to pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ffdebug.errors import FFDebugError

_TRUE = {"yes", "y", "true", "1", "on"}
_FALSE = {"no", "n", "false", "0", "off"}


class TriageError(FFDebugError):
    """The tree is malformed, or an answer is missing or invalid."""


@dataclass(frozen=True)
class Question:
    """One node of the tree: a yes/no question or a choice."""

    id: str
    ask: str
    flag: str
    branches: dict  # answer (True / False / choice string) -> next node id
    default: object = None
    hint: str | None = None

    @property
    def is_choice(self) -> bool:
        """True for a multiple-choice question (string answers), False for yes/no."""
        return not (set(self.branches) <= {True, False})

    def parse_answer(self, raw: object) -> object:
        """Normalise a given answer (bool, 'yes', 'no', a choice); an error listing the valid ones."""
        if self.is_choice:
            value = str(raw).strip().lower()
            if value not in self.branches:
                raise TriageError(
                    f"--{self.flag} {raw!r} is not one of {', '.join(str(c) for c in self.branches)}"
                )
            return value
        if isinstance(raw, bool):
            return raw
        value = str(raw).strip().lower()
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        raise TriageError(f"--{self.flag}: answer yes or no, got {raw!r}")

    def flag_help(self) -> str:
        """How to answer this question on the command line."""
        if self.is_choice:
            return f"--{self.flag} {'|'.join(str(c) for c in self.branches)}"
        return f"--{self.flag} / --no-{self.flag}"


@dataclass(frozen=True)
class Outcome:
    """Where to start: a playbook, a phase or section, a sentence, and the commands to run."""

    id: str
    playbook: str
    say: str
    phase: int | None = None
    section: str | None = None
    commands: tuple[str, ...] = ()


@dataclass(frozen=True)
class Tree:
    """A validated decision tree."""

    start: str
    questions: dict[str, Question]
    outcomes: dict[str, Outcome]

    @property
    def flags(self) -> dict[str, list[Question]]:
        """Flag name -> the questions it answers."""
        out: dict[str, list[Question]] = {}
        for q in self.questions.values():
            out.setdefault(q.flag, []).append(q)
        return out


@dataclass
class Step:
    """One answered question on the path taken."""

    question: str
    flag: str
    ask: str
    answer: object
    how: str  # "given" | "assumed" | "asked"


@dataclass
class TriageResult:
    """The outcome of walking the tree, with the path that led there."""

    outcome: Outcome
    steps: list[Step] = field(default_factory=list)
    title: str = ""
    goal: str | None = None
    done_when: str | None = None
    commands: list[str] = field(default_factory=list)
    next_phases: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        """Stable keys: outcome, playbook, phase, section, title, say, commands, answers, next."""
        o = self.outcome
        return {
            "outcome": o.id,
            "playbook": o.playbook,
            "phase": o.phase,
            "section": o.section,
            "title": self.title,
            "say": o.say,
            "goal": self.goal,
            "done_when": self.done_when,
            "commands": self.commands,
            "answers": [
                {"question": s.question, "flag": s.flag, "answer": s.answer, "how": s.how} for s in self.steps
            ],
            "next": self.next_phases,
        }


def _branch_key(raw: object) -> object:
    # YAML reads yes/no keys as booleans already; accept "yes"/"no" strings too.
    if isinstance(raw, bool):
        return raw
    s = str(raw).lower()
    return True if s == "yes" else False if s == "no" else s


def _parse_question(qid: object, q: object, w: str) -> Question:
    """One `questions:` entry: `ask`, yes/no branches or `choices`, optional flag, default, hint."""
    if not isinstance(q, dict) or not isinstance(q.get("ask"), str):
        raise TriageError(f"{w}: needs 'ask' (the question)")
    extra = set(q) - {"ask", "flag", "yes", "no", True, False, "choices", "default", "hint"}
    if extra:
        raise TriageError(f"{w}: unknown key(s) {', '.join(sorted(map(str, extra)))}")
    if "choices" in q:
        if not isinstance(q["choices"], dict) or not q["choices"]:
            raise TriageError(f"{w}: 'choices' must map answers to next nodes")
        branches = {str(k).lower(): str(v) for k, v in q["choices"].items()}
    else:
        branches = {_branch_key(k): str(v) for k, v in q.items() if k in ("yes", "no", True, False)}
        if set(branches) != {True, False}:
            raise TriageError(f"{w}: a yes/no question needs both 'yes' and 'no' (or 'choices')")
    question = Question(
        id=str(qid),
        ask=" ".join(q["ask"].split()),
        flag=str(q.get("flag", qid)),
        branches=branches,
        hint=" ".join(q["hint"].split()) if isinstance(q.get("hint"), str) else None,
    )
    if "default" in q:
        question = replace(question, default=question.parse_answer(q["default"]))
    return question


def _parse_outcome(oid: object, o: object, books: dict, w: str) -> Outcome:
    """One `outcomes:` entry, checked against the playbook (and phase or section) it names."""
    if not isinstance(o, dict) or not isinstance(o.get("playbook"), str) or not isinstance(o.get("say"), str):
        raise TriageError(f"{w}: needs 'playbook' and 'say'")
    extra = set(o) - {"playbook", "phase", "section", "say", "commands"}
    if extra:
        raise TriageError(f"{w}: unknown key(s) {', '.join(sorted(extra))}")
    book = books.get(o["playbook"])
    if book is None:
        raise TriageError(f"{w}: no playbook {o['playbook']!r}")
    if o.get("phase") is not None:
        book.section_for_phase(o["phase"])
    if o.get("section") is not None and o["section"] not in {s.id for s in book.sections}:
        raise TriageError(f"{w}: playbook {book.name!r} has no section {o['section']!r}")
    cmds = o.get("commands") or []
    if not isinstance(cmds, list) or not all(isinstance(c, str) for c in cmds):
        raise TriageError(f"{w}: 'commands' must be a list of strings")
    return Outcome(
        id=str(oid),
        playbook=o["playbook"],
        say=" ".join(o["say"].split()),
        phase=o.get("phase"),
        section=o.get("section"),
        commands=tuple(c.strip() for c in cmds),
    )


def _check_links(
    start: object, questions: dict[str, Question], outcomes: dict[str, Outcome], where: str
) -> None:
    """Ids unique across questions and outcomes, `start` a question, every answer leads somewhere."""
    clash = set(questions) & set(outcomes)
    if clash:
        raise TriageError(f"{where}: ids used for both a question and an outcome: {', '.join(sorted(clash))}")
    if start not in questions:
        raise TriageError(f"{where}: 'start' must name a question, got {start!r}")
    for q in questions.values():
        for answer, nxt in q.branches.items():
            if nxt not in questions and nxt not in outcomes:
                raise TriageError(
                    f"{where}.questions.{q.id}: answer {answer!r} leads to unknown node {nxt!r}"
                )


def parse_tree(data: dict, books: dict, where: str) -> Tree:
    """Validate the `triage:` mapping against the playbooks it points into."""
    if not isinstance(data, dict):
        raise TriageError(f"{where}: must be a mapping")
    unknown = set(data) - {"start", "questions", "outcomes"}
    if unknown:
        raise TriageError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    raw_q, raw_o = data.get("questions"), data.get("outcomes")
    if not isinstance(raw_q, dict) or not raw_q or not isinstance(raw_o, dict) or not raw_o:
        raise TriageError(f"{where}: 'questions' and 'outcomes' must be non-empty mappings")
    questions: dict[str, Question] = {}
    for qid, q in raw_q.items():
        question = _parse_question(qid, q, f"{where}.questions.{qid}")
        questions[question.id] = question
    outcomes = {
        str(oid): _parse_outcome(oid, o, books, f"{where}.outcomes.{oid}") for oid, o in raw_o.items()
    }
    start = data.get("start")
    _check_links(start, questions, outcomes, where)
    tree = Tree(start=start, questions=questions, outcomes=outcomes)
    _check_acyclic(tree, where)
    kinds: dict[str, bool] = {}
    for q in questions.values():
        if kinds.setdefault(q.flag, q.is_choice) != q.is_choice:
            raise TriageError(f"{where}: flag --{q.flag} is used by both a yes/no and a choice question")
    return tree


def _check_acyclic(tree: Tree, where: str) -> None:
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        if node in tree.outcomes:
            return
        if state.get(node) == 1:
            raise TriageError(f"{where}: the questions loop: {' -> '.join([*path, node])}")
        if state.get(node) == 2:
            return
        state[node] = 1
        for nxt in tree.questions[node].branches.values():
            visit(nxt, [*path, node])
        state[node] = 2

    visit(tree.start, [])
    unreachable = set(tree.questions) - set(state)
    if unreachable:
        raise TriageError(f"{where}: question(s) never reached: {', '.join(sorted(unreachable))}")


def load_tree() -> Tree:
    """The tree shipped in `playbooks/dump-bisect.yaml` (validated)."""
    from ffdebug.review.playbooks import load, load_all

    books = load_all()
    book = load("dump-bisect")
    if book.triage is None:
        raise TriageError(f"{book.path}: has no 'triage' decision tree")
    return parse_tree(book.triage, books, f"{book.path}: triage")


def walk(
    tree: Tree, answers: dict[str, object], ask: Callable[[Question], object] | None = None
) -> TriageResult:
    """Follow the tree from `start` using `answers` (flag -> value), `ask` for the rest, then defaults.

    Without an answer, a prompt (`ask`) or a default, raise an error naming the flag to pass.
    """
    from ffdebug.review.playbooks import load

    flags = tree.flags
    stray = sorted(set(answers) - set(flags))
    if stray:
        raise TriageError(
            f"unknown triage answer(s) {', '.join(stray)}; questions: {', '.join(sorted(flags))}"
        )
    steps: list[Step] = []
    node = tree.start
    while node in tree.questions:
        q = tree.questions[node]
        if answers.get(q.flag) is not None:
            answer, how = q.parse_answer(answers[q.flag]), "given"
        elif ask is not None:
            answer, how = q.parse_answer(ask(q)), "asked"
        elif q.default is not None:
            answer, how = q.default, "assumed"
        else:
            raise TriageError(f"triage needs an answer to: {q.ask} Pass {q.flag_help()} (or --interactive)")
        steps.append(Step(q.id, q.flag, q.ask, answer, how))
        node = q.branches[answer]
    outcome = tree.outcomes[node]
    book = load(outcome.playbook)
    if outcome.phase is not None:
        section = book.section_for_phase(outcome.phase)
    elif outcome.section is not None:
        section = next(s for s in book.sections if s.id == outcome.section)
    else:
        section = book.sections[0]
    commands = list(outcome.commands) or [c for item in section.items for c in item.command]
    later = [
        s
        for s in book.sections
        if s.phase is not None and section.phase is not None and s.phase > section.phase
    ]
    return TriageResult(
        outcome=outcome,
        steps=steps,
        title=f"{book.title}: "
        + (f"phase {section.phase}, " if section.phase is not None else "")
        + section.title,
        goal=section.goal,
        done_when=section.done_when,
        commands=commands,
        next_phases=[f"phase {s.phase}: {s.title}" for s in later[:2]],
    )
