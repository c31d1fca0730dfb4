"""GBNF -> Lark with llguidance's converter, in linear time.

The converter finds the rules that only ever match terminals (they become lexer terminals) by sweeping all
rules until nothing changes; on a chain of N rules that is N sweeps, O(N^2): 20k rules took tens of minutes.
The same least fixpoint is found here first, each rule counting down the rules it waits for, so the
converter's own sweep ends after one pass. Its parser and printer are used as they are.
"""

from __future__ import annotations

from collections import defaultdict

from llguidance.gbnf_to_lark import GrammarParser, RuleNode, RuleRefNode, is_lark_syntax, resolve


def any_to_lark(text: str) -> str:
    """Lark text as it is; GBNF (rules written with ::=) converted (errors as the converter raises them)."""
    if is_lark_syntax(text):
        return text
    rules = GrammarParser().parse(text)
    _mark_terminal_rules(rules)
    resolve(rules)
    out = ["%llguidance {}\n\n"]
    prev_nl = True
    for r in sorted(rules.values(), key=lambda r: r.order):  # the converter's layout, joined once
        s = str(r)
        if not prev_nl and "\n" in s:
            out.append("\n")
        out.append(s + "\n")
        prev_nl = "\n" in s
        if prev_nl:
            out.append("\n")
    return "".join(out)


def _mark_terminal_rules(rules: dict[str, RuleNode]) -> None:
    """Sets `rule_is_terminal` where the converter's sweep would: a rule (not the root) all of whose
    references are terminal rules. A rule waiting on itself, or on the root, never is."""
    waiting: dict[str, int] = {}
    users: dict[str, list[str]] = defaultdict(list)
    for r in rules.values():
        refs = {node.name for node in _nodes(r.alternatives) if isinstance(node, RuleRefNode)}
        if not refs <= rules.keys():
            return  # a missing rule: the converter reports it
        waiting[r.name] = len(refs)
        for name in refs:
            users[name].append(r.name)
    ready = [name for name, n in waiting.items() if n == 0]
    while ready:
        name = ready.pop()
        if name == "root":
            continue
        rules[name].rule_is_terminal = True
        for user in users[name]:
            waiting[user] -= 1
            if waiting[user] == 0:
                ready.append(user)


def _nodes(node):
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children())
