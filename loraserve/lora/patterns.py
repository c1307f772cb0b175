"""Adapter-config regexes, compiled once and matched in time linear in their size.

PEFT matches a ``rank_pattern`` / ``alpha_pattern`` key with ``re.match(rf"(.*\\.)?({key})$", name)``,
first key in file order wins. Python's ``re`` backtracks, so a hostile key such as ``(.+)+x`` takes
about 2^len(name) steps on one module name: an adapter file could hold its loader (and a shutdown) for
ever. Every key is parsed once and matched by one of two means, both giving PEFT's answer:

- a key without repetition or alternation: Python's ``re`` itself, compiled once. Its one choice point
  is PEFT's ``(.*\\.)?`` prefix, so a match takes O(len(name) * len(key)) steps;
- any other key: a Thompson automaton simulated over the name (sets of states, no backtracking):
  O(len(name) * states). Backreferences, lookarounds, conditionals, atomic groups, possessive repeats
  and the flags i, m, a, L have no such automaton here and are refused by name.

``MAX_PATTERN_CHARS``, ``MAX_PATTERN_KEYS``, ``MAX_AUTOMATON_KEYS`` and ``MAX_STATES`` bound the work one
config can ask for. A string ``target_modules`` is only validated (tensor keys decide what is served), so
it is length-capped and compiled, never matched.
"""

from __future__ import annotations

import re

try:  # Python >= 3.11
    from re import _constants as C
    from re import _parser as sre_parse
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as C  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

from loraserve.lora.errors import LoRAFormatError, LoRAUnsupportedFeatureError

MAX_PATTERN_CHARS = 512  # one key or target_modules regex; real ones are module paths, < 200 characters
MAX_PATTERN_KEYS = 4096  # keys per rank_pattern / alpha_pattern (an 80-layer model with 7 modules needs 560)
MAX_AUTOMATON_KEYS = 32  # keys per dict that need the automaton (repetition or alternation)
MAX_STATES = 4096  # automaton states of one key, after expanding {m,n} counts
_CACHE_LIMIT = 1 << 14  # memoized automaton transitions per key, before the memo is cleared

_CHAR, _SPLIT, _AT, _MATCH = range(4)
_REFUSED_FLAGS = {
    C.SRE_FLAG_IGNORECASE: "(?i)",
    C.SRE_FLAG_MULTILINE: "(?m)",
    C.SRE_FLAG_ASCII: "(?a)",
    C.SRE_FLAG_LOCALE: "(?L)",
}
_NOT_AUTOMATON = {
    C.GROUPREF: "a backreference",
    C.GROUPREF_EXISTS: "a conditional group",
    C.ASSERT: "a lookaround",
    C.ASSERT_NOT: "a lookaround",
}
for _name, _what in (("ATOMIC_GROUP", "an atomic group"), ("POSSESSIVE_REPEAT", "a possessive repeat")):
    if hasattr(C, _name):  # Python >= 3.11
        _NOT_AUTOMATON[getattr(C, _name)] = _what
_REPEATS = (C.MAX_REPEAT, C.MIN_REPEAT)


def _is_word(ch: str) -> bool:
    return ch.isalnum() or ch == "_"  # sre's Unicode \w


_CATEGORIES = {
    C.CATEGORY_DIGIT: str.isdecimal,
    C.CATEGORY_NOT_DIGIT: lambda ch: not ch.isdecimal(),
    C.CATEGORY_SPACE: str.isspace,
    C.CATEGORY_NOT_SPACE: lambda ch: not ch.isspace(),
    C.CATEGORY_WORD: _is_word,
    C.CATEGORY_NOT_WORD: lambda ch: not _is_word(ch),
}


class PatternRefused(Exception):
    """A key the linear matcher cannot take; the caller words the LoRAError."""


def _class_predicate(items):
    negate = bool(items) and items[0][0] == C.NEGATE
    tests = []
    for op, av in items[1:] if negate else items:
        if op == C.LITERAL:
            tests.append(lambda ch, c=chr(av): ch == c)
        elif op == C.RANGE:
            tests.append(lambda ch, lo=av[0], hi=av[1]: lo <= ord(ch) <= hi)
        elif op == C.CATEGORY and av in _CATEGORIES:
            tests.append(_CATEGORIES[av])
        else:
            raise PatternRefused(f"the character class item {op} {av}")
    if negate:
        return lambda ch: not any(t(ch) for t in tests)
    return lambda ch: any(t(ch) for t in tests)


class _Automaton:
    """Thompson automaton of a parsed pattern: ``match(s)`` = ``re.match(pattern, s) is not None``
    (``full``: ``re.fullmatch``), for patterns made of literals, classes, groups, alternation, repeats
    and the anchors ^ $ \\A \\Z \\b \\B."""

    def __init__(self, parsed, full: bool):
        self.kind: list[int] = []
        self.arg: list = []
        self.out: list[list[int]] = []
        flags = parsed.state.flags
        for flag, spelled in _REFUSED_FLAGS.items():
            if flags & flag:
                raise PatternRefused(f"the flag {spelled}")
        self.accept = self._add(_MATCH, None, [])
        self.start = self._emit(list(parsed), self.accept, bool(flags & C.SRE_FLAG_DOTALL))
        self.full = full
        self.has_anchors = _AT in self.kind
        # word flags enter the memo keys only where \b or \B reads them
        self.reads_words = any(a in (C.AT_BOUNDARY, C.AT_NON_BOUNDARY) for a in self.arg if not callable(a))
        self._closures: dict = {}
        self._steps: dict = {}

    def _add(self, kind: int, arg, out: list[int]) -> int:
        if len(self.kind) >= MAX_STATES:
            raise PatternRefused(f"more than {MAX_STATES} automaton states (large {{m,n}} counts)")
        self.kind.append(kind)
        self.arg.append(arg)
        self.out.append(out)
        return len(self.kind) - 1

    def _emit(self, items, nxt: int, dotall: bool) -> int:
        """Build ``items`` backwards: the entry state of a path that continues at ``nxt``."""
        for op, av in reversed(items):
            nxt = self._emit_one(op, av, nxt, dotall)
        return nxt

    def _emit_one(self, op, av, nxt: int, dotall: bool) -> int:
        if op == C.LITERAL:
            return self._add(_CHAR, lambda ch, c=chr(av): ch == c, [nxt])
        if op == C.NOT_LITERAL:
            return self._add(_CHAR, lambda ch, c=chr(av): ch != c, [nxt])
        if op == C.ANY:
            return self._add(_CHAR, (lambda ch: True) if dotall else (lambda ch: ch != "\n"), [nxt])
        if op == C.IN:
            return self._add(_CHAR, _class_predicate(av), [nxt])
        if op == C.BRANCH:
            return self._add(_SPLIT, None, [self._emit(list(alt), nxt, dotall) for alt in av[1]])
        if op == C.SUBPATTERN:
            _, add_flags, del_flags, sub = av
            for flag, spelled in _REFUSED_FLAGS.items():
                if add_flags & flag:
                    raise PatternRefused(f"the flag {spelled}")
            if add_flags & C.SRE_FLAG_DOTALL:
                dotall = True
            if del_flags & C.SRE_FLAG_DOTALL:
                dotall = False
            return self._emit(list(sub), nxt, dotall)
        if op in _REPEATS:  # greedy or lazy: the same language, and a match is all we ask
            lo, hi, sub = av
            if hi == C.MAXREPEAT:  # sub* : a loop through one split state
                loop = self._add(_SPLIT, None, [])
                self.out[loop] = [self._emit(list(sub), loop, dotall), nxt]
                nxt = loop
            else:
                for _ in range(hi - lo):  # optional copies: sub? sub? ... (same language as nested ones)
                    nxt = self._add(_SPLIT, None, [self._emit(list(sub), nxt, dotall), nxt])
            for _ in range(lo):
                nxt = self._emit(list(sub), nxt, dotall)
            return nxt
        if op == C.AT:
            return self._add(_AT, av, [nxt])
        raise PatternRefused(_NOT_AUTOMATON.get(op, f"the construct {op}"))

    def _holds(self, at, ctx) -> bool:
        at_start, at_end, before_final_newline, prev_word, next_word, empty = ctx
        if at in (C.AT_BEGINNING, C.AT_BEGINNING_STRING):
            return at_start
        if at == C.AT_END:
            return at_end or before_final_newline
        if at == C.AT_END_STRING:
            return at_end
        if at == C.AT_BOUNDARY:
            return not empty and prev_word != next_word
        if at == C.AT_NON_BOUNDARY:
            return not empty and prev_word == next_word
        raise PatternRefused(f"the anchor {at}")

    def _closure(self, states: frozenset[int], ctx) -> frozenset[int]:
        key = (states, ctx)
        got = self._closures.get(key)
        if got is None:
            seen, todo = set(), list(states)
            while todo:
                s = todo.pop()
                if s in seen:
                    continue
                seen.add(s)
                kind = self.kind[s]
                if kind == _SPLIT or (kind == _AT and self._holds(self.arg[s], ctx)):
                    todo.extend(self.out[s])
            got = frozenset(s for s in seen if self.kind[s] in (_CHAR, _MATCH))
            if len(self._closures) > _CACHE_LIMIT:
                self._closures.clear()
            self._closures[key] = got
        return got

    def _step(self, states: frozenset[int], ch: str) -> frozenset[int]:
        key = (states, ch)
        got = self._steps.get(key)
        if got is None:
            got = frozenset(self.out[s][0] for s in states if self.kind[s] == _CHAR and self.arg[s](ch))
            if len(self._steps) > _CACHE_LIMIT:
                self._steps.clear()
            self._steps[key] = got
        return got

    def _ctx(self, s: str, pos: int):
        if not self.has_anchors:
            return None
        n = len(s)
        return (
            pos == 0,
            pos == n,
            pos == n - 1 and s[-1] == "\n",
            self.reads_words and pos > 0 and _is_word(s[pos - 1]),
            self.reads_words and pos < n and _is_word(s[pos]),
            n == 0,
        )

    def match(self, s: str) -> bool:
        cur = self._closure(frozenset((self.start,)), self._ctx(s, 0))
        for i, ch in enumerate(s):
            if not self.full and self.accept in cur:
                return True
            cur = self._step(cur, ch)
            if not cur:
                return False
            cur = self._closure(cur, self._ctx(s, i + 1))
        return self.accept in cur


def _needs_automaton(items) -> bool:
    """Whether a parsed pattern has a choice point (repetition, alternation, a conditional) where ``re``
    could backtrack; groups, lookarounds and atomic groups are looked into."""
    for op, av in items:
        if (
            op in _REPEATS
            or op in (C.BRANCH, C.GROUPREF_EXISTS)
            or op == getattr(C, "POSSESSIVE_REPEAT", None)
        ):
            return True
        sub = None
        if op == C.SUBPATTERN:
            sub = av[3]
        elif op in (C.ASSERT, C.ASSERT_NOT):
            sub = av[1]
        elif op == getattr(C, "ATOMIC_GROUP", None):
            sub = av
        if sub is not None and _needs_automaton(sub):
            return True
    return False


class PatternTable:
    """A ``rank_pattern`` / ``alpha_pattern`` dict, compiled once: ``lookup(name)`` is PEFT's
    ``get_pattern_key`` (the first key in the file's order with ``re.match(rf"(.*\\.)?({key})$", name)``)
    and returns that key's value, or None. Raises LoRAFormatError / LoRAUnsupportedFeatureError naming
    ``where`` and the key for a key over the limits or one the linear matcher refuses."""

    def __init__(self, pattern: dict, field: str, where: str):
        if len(pattern) > MAX_PATTERN_KEYS:
            raise LoRAFormatError(
                f"{where}: {field} has {len(pattern)} keys, more than the {MAX_PATTERN_KEYS} loraserve reads; "
                f"merge them into fewer patterns"
            )
        self._entries: list[tuple[object, object]] = []
        automata = 0
        for key, value in pattern.items():
            if not isinstance(key, str) or len(key) > MAX_PATTERN_CHARS:
                raise LoRAFormatError(
                    f"{where}: {field} key {str(key)[:80]!r}... is longer than {MAX_PATTERN_CHARS} characters "
                    f"(or not a string); module patterns are short paths"
                )
            wrapped = rf"(.*\.)?({key})$"
            try:
                simple = not _needs_automaton(sre_parse.parse(key))
            except (re.error, RecursionError, OverflowError):
                simple = False  # e.g. unbalanced on its own, as "a)|(b": PEFT's wrapped form decides below
            try:
                if simple:
                    self._entries.append((re.compile(wrapped).match, value))
                    continue
                automata += 1
                if automata > MAX_AUTOMATON_KEYS:
                    raise PatternRefused(
                        f"more than {MAX_AUTOMATON_KEYS} keys with repetition or alternation in {field}"
                    )
                self._entries.append((_Automaton(sre_parse.parse(wrapped), full=False).match, value))
            except (re.error, RecursionError, OverflowError) as e:
                raise LoRAFormatError(f"{where}: {field} key {key!r} is not a valid regex ({e})") from None
            except PatternRefused as e:
                raise LoRAUnsupportedFeatureError(
                    f"{where}: {field} key {key!r} uses {e}, which loraserve does not match (it matches "
                    f"patterns in linear time); rewrite the key without it"
                ) from None

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, name: str):
        for match, value in self._entries:
            if match(name):
                return value
        return None


def check_target_regex(pattern: str, where: str) -> None:
    """A string ``target_modules``: at most MAX_PATTERN_CHARS and a valid regex. Only validated (the
    tensor keys decide which modules are served), so never matched against anything."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise LoRAFormatError(
            f"{where}: target_modules is a regex of {len(pattern)} characters, more than {MAX_PATTERN_CHARS}; "
            f"shorten it or save a list of module names"
        )
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        raise LoRAFormatError(f"{where}: target_modules {pattern!r} is not a valid regex: {e}") from None


def dot_suffixes(name: str) -> list[str]:
    """``name`` and each of its tails that starts after a dot: what PEFT's list rule (equal, or a suffix
    at a dot) can match, so a set lookup replaces a scan over a long list."""
    parts = name.split(".")
    return [".".join(parts[i:]) for i in range(len(parts))]
