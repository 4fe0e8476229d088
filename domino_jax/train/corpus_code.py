"""Code prompts (kind ``code``): tasks over real functions of the CPython standard library
and of installed dependency packages (numpy, jax, flax, optax, orbax), plus procedurally
composed programming requests.

Standard-library tasks (:func:`stdlib_code_prompts`) parse every stdlib ``.py`` file with
:mod:`ast` (tests, vendored and demo folders excluded; files in sorted order, so a given
Python version always yields the same functions) and keep functions and methods of 4-30
lines. Each function is used for ONE code-showing task (explain, document, fix an injected
bug, complete, review, add type hints, write tests, complexity, translate) and, if it has a
docstring, for one "write a function from this docstring" task, so no two prompts share the
same snippet. Bugs are injected by mutating one AST node (a comparison, arithmetic or boolean
operator, a small constant or a returned boolean).
"""

from __future__ import annotations

import ast
import dataclasses
import os
import random
import sysconfig
import textwrap
from typing import Iterator

from domino_jax.train import corpus_parse

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
             "lib2to3", "turtledemo", "ensurepip", "_vendor", "vendored", "third_party"}
MAX_LINES, MIN_LINES, MAX_CHARS = 30, 4, 1400


@dataclasses.dataclass(frozen=True)
class Function:
    module: str          # dotted module name, e.g. "email.utils"
    qualname: str        # "Class.method" or "function"
    source: str          # dedented source, decorators included
    docstring: str       # "" if none
    signature: str       # "name(args)"
    is_method: bool
    doc_lines: tuple[int, int] | None   # docstring's (first, last) line within ``source``, 0-based


def python_files(root: str) -> list[str]:
    """All ``.py`` files under ``root`` in sorted order, skipping :data:`SKIP_DIRS`."""
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        out += [os.path.join(folder, f) for f in sorted(files) if f.endswith(".py")]
    return out


def module_name(root: str, path: str) -> str:
    rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
    return rel[:-9] if rel.endswith(".__init__") else rel


def iter_functions(roots: list[tuple[str, str]] | None = None, rng: random.Random | None = None
                   ) -> Iterator[Function]:
    """Functions and methods of ``MIN_LINES..MAX_LINES`` lines in the ``.py`` files under
    ``roots`` (``(package prefix, folder)`` pairs; default: the running Python's stdlib, no
    prefix). Files in sorted order, or shuffled by ``rng`` (each file is read only when the
    iteration reaches it, and parsed once per process: :mod:`corpus_parse`)."""
    roots = roots or [("", sysconfig.get_paths()["stdlib"])]
    paths = [(prefix, root, path) for prefix, root in roots for path in python_files(root)]
    if rng is not None:
        rng.shuffle(paths)
    for prefix, root, path in paths:
        found = corpus_parse.facts(path, "functions")
        if found is None:
            continue
        module = module_name(root, path)
        module = f"{prefix}.{module}" if prefix and module else (prefix or module)
        functions = [Function(module, *fields) for fields in found]
        if rng is not None:
            rng.shuffle(functions)
        yield from functions


@corpus_parse.extractor("functions")
def _file_functions(text: str, tree: ast.Module) -> tuple[tuple, ...]:
    """A file's functions in :func:`iter_functions`' order, each as the fields of its
    :class:`Function` after ``module`` (which depends on the root the file is listed under)."""
    return tuple(_functions_in(tree, text.splitlines()))


def _functions_in(tree: ast.Module, lines: list[str]) -> Iterator[tuple]:
    stack: list[tuple[ast.AST, str]] = [(tree, "")]
    while stack:
        node, prefix = stack.pop(0)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                stack.append((child, f"{prefix}{child.name}."))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                fields = _function(child, lines, prefix, isinstance(node, ast.ClassDef))
                if fields is not None:
                    yield fields


def _function(node, lines, prefix, is_method) -> tuple | None:
    """:class:`Function` fields after ``module`` for a def of the right size, else None."""
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    n = node.end_lineno - first + 1
    if not MIN_LINES <= n <= MAX_LINES or node.name.startswith("test"):
        return None
    source = textwrap.dedent("\n".join(lines[first - 1:node.end_lineno])) + "\n"
    if len(source) > MAX_CHARS or "\t" in source:
        return None
    doc = ast.get_docstring(node) or ""
    doc_lines = None
    body0 = node.body[0]
    if doc and isinstance(body0, ast.Expr):
        doc_lines = (body0.lineno - first, body0.end_lineno - first)
    return (prefix + node.name, source, doc, f"{node.name}({ast.unparse(node.args)})",
            is_method, doc_lines)


# ---------------------------------------------------------------- bug injection

_SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
          ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot,
          ast.IsNot: ast.Is, ast.Add: ast.Sub, ast.Sub: ast.Add, ast.And: ast.Or, ast.Or: ast.And,
          ast.Mult: ast.Add}


def inject_bug(source: str, rng: random.Random) -> str | None:
    """``source`` with one deliberate bug (via ``ast``), unparsed; None if nothing to mutate.

    Candidate mutations: swap a comparison / arithmetic / boolean operator, add 1 to a small
    integer constant, flip a returned ``True``/``False``, drop a ``not``."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    sites = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sites += [(node, "cmp", i) for i, op in enumerate(node.ops) if type(op) in _SWAPS]
        elif isinstance(node, (ast.BinOp, ast.BoolOp)) and type(node.op) in _SWAPS:
            sites.append((node, "op", None))
        elif (isinstance(node, ast.Constant) and type(node.value) is int
              and 0 <= node.value <= 2):
            sites.append((node, "int", None))
        elif isinstance(node, ast.Return) and isinstance(node.value, ast.Constant) \
                and type(node.value.value) is bool:
            sites.append((node, "ret", None))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            sites.append((node, "not", None))
    if not sites:
        return None
    original = ast.unparse(tree)
    node, what, index = rng.choice(sites)
    # The tree is mutated in place: it is this call's own parse and ``original`` is taken.
    # Every mutation assigns a field of a node of its own (a Compare, BinOp, BoolOp,
    # Constant or the parent of a ``not``), never one of the operator singletons that
    # parses share.
    if what == "cmp":
        node.ops[index] = _SWAPS[type(node.ops[index])]()
    elif what == "op":
        node.op = _SWAPS[type(node.op)]()
    elif what == "int":
        node.value += 1
    elif what == "ret":
        node.value.value = not node.value.value
    else:
        _replace_node(tree, node, node.operand)
    buggy = ast.unparse(tree)
    return buggy + "\n" if buggy != original else None


def _replace_node(tree, old, new) -> None:
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, field, new)
                return
            if isinstance(value, list):
                for i, item in enumerate(value):
                    if item is old:
                        value[i] = new
                        return


# ---------------------------------------------------------------- stdlib tasks

def _block(code: str) -> str:
    return f"```python\n{code.rstrip()}\n```"


def _what(fn: Function, rng: random.Random) -> str:
    kind = "method" if fn.is_method else "function"
    return rng.choice([f"this {kind}", f"this Python {kind}", f"the following {kind}",
                       f"`{fn.qualname}` from the `{fn.module}` module", "this code"])


def _first_paragraph(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())


LANGUAGES = ["JavaScript", "TypeScript", "Go", "Rust", "Java", "C++", "C#", "Kotlin", "Ruby",
             "Julia", "Swift", "Lua"]


def _without_docstring(fn: Function) -> str:
    if fn.doc_lines is None:
        return fn.source
    lines = fn.source.splitlines()
    a, b = fn.doc_lines
    kept = lines[:a] + lines[b + 1:]
    return "\n".join(kept) + "\n" if len(kept) > 1 else fn.source


def show_code_task(fn: Function, rng: random.Random) -> tuple[str, str] | None:
    """One code-showing task for ``fn``: ``(task, prompt)`` or None if the drawn task does
    not apply (e.g. nothing to mutate)."""
    task = rng.choice(["explain", "explain", "document", "fix_bug", "fix_bug", "complete",
                       "review", "type_hints", "tests", "complexity", "translate", "refactor"])
    what = _what(fn, rng)
    if task == "explain":
        ask = rng.choice([f"Explain what {what} does.", f"What does {what} do? Describe it briefly.",
                          f"Walk me through {what} line by line.",
                          f"Can you explain {what} to a beginner?",
                          f"Summarise the behaviour of {what}, including edge cases."])
        return task, f"{ask}\n\n{_block(fn.source)}"
    if task == "document":
        ask = rng.choice([f"Write a docstring for {what}.",
                          f"Add a clear docstring (arguments, return value, errors) to {what}.",
                          f"Document {what} in Google docstring style.",
                          f"Write a short reference-manual entry for {what}."])
        return task, f"{ask}\n\n{_block(_without_docstring(fn))}"
    if task == "fix_bug":
        buggy = inject_bug(fn.source, rng)
        if buggy is None:
            return None
        goal = _first_paragraph(fn.docstring)
        lead = (f"This {'method' if fn.is_method else 'function'} should do the following: "
                f"\"{goal}\" But it has a bug." if goal and len(goal) < 300 else
                rng.choice(["There is a bug in this function.", "This code has a subtle bug.",
                            "Something is wrong with this function."]))
        ask = rng.choice(["Find it and fix it.", "Can you spot the bug and correct it?",
                          "Explain what is wrong and give the fixed version.",
                          "Where is the mistake?"])
        return task, f"{lead} {ask}\n\n{_block(buggy)}"
    if task == "complete":
        lines = fn.source.rstrip().splitlines()
        start = (fn.doc_lines[1] + 1) if fn.doc_lines else 1
        body = len(lines) - start
        if body < 2:
            return None
        cut = start + max(1, body // 2)
        ask = rng.choice(["Complete this function.", "Finish the implementation below.",
                          "Write the rest of this function.",
                          f"Complete `{fn.signature.split('(')[0]}` so that it works."])
        return task, f"{ask}\n\n{_block(chr(10).join(lines[:cut]))}"
    if task == "review":
        ask = rng.choice([f"Review {what}. Is there anything you would change?",
                          f"What are the strengths and weaknesses of {what}?",
                          f"Could {what} fail on some inputs? Give examples."])
    elif task == "type_hints":
        ask = rng.choice([f"Add type hints to {what}.", f"Annotate {what} with Python type hints."])
    elif task == "tests":
        ask = rng.choice([f"Write pytest unit tests for {what}.",
                          f"What test cases would you write for {what}? Write them with unittest.",
                          f"Suggest edge-case tests for {what}."])
    elif task == "complexity":
        ask = rng.choice([f"What is the time and space complexity of {what}?",
                          f"Analyse the performance of {what}. Can it be made faster?"])
    elif task == "translate":
        ask = rng.choice([f"Rewrite {what} in {rng.choice(LANGUAGES)}.",
                          f"Translate {what} into idiomatic {rng.choice(LANGUAGES)}."])
    else:
        ask = rng.choice([f"Refactor {what} to make it easier to read.",
                          f"Simplify {what} without changing its behaviour.",
                          f"How would you rewrite {what} in a more modern Python style?"])
    return task, f"{ask}\n\n{_block(fn.source)}"


def write_from_doc_task(fn: Function, rng: random.Random) -> str | None:
    """"Write a function from its docstring" (the code itself is not shown)."""
    doc = _first_paragraph(fn.docstring)
    if len(doc.split()) < 6 or len(doc) > 500:
        return None
    kind = "method" if fn.is_method else "function"
    form = rng.randrange(4)
    if form == 0:
        return f"Write a Python {kind} `{fn.signature}` that does the following: {doc}"
    if form == 1:
        return f"Implement `{fn.signature}` in Python.\n\nSpecification: {doc}"
    if form == 2:
        return (f"I need a Python {kind} named `{fn.signature.split('(')[0]}`. Here is what it "
                f"should do:\n\n{doc}\n\nPlease write it with a short explanation.")
    return f"Here is a docstring:\n\n\"\"\"{doc}\"\"\"\n\nWrite a {kind} `{fn.signature}` that matches it."


def function_prompts(rng: random.Random, label: str = "stdlib",
                     roots: list[tuple[str, str]] | None = None) -> Iterator[tuple[str, str]]:
    """``(source, prompt)`` over the functions under ``roots`` (default: the stdlib) in a
    seeded order (files shuffled, then functions within a file): for each function one
    code-showing task (``<label>.code.<task>``) and, when it has a docstring, one
    ``<label>.code.write_from_doc`` task."""
    for fn in iter_functions(roots, rng):
        shown = show_code_task(fn, rng)
        if shown is not None:
            yield f"{label}.code.{shown[0]}", shown[1]
        if fn.docstring and rng.random() < 0.85:
            written = write_from_doc_task(fn, rng)
            if written is not None:
                yield f"{label}.code.write_from_doc", written


def stdlib_code_prompts(rng: random.Random) -> Iterator[tuple[str, str]]:
    return function_prompts(rng, "stdlib")


def package_code_prompts(rng: random.Random, packages: list[tuple[str, str]]
                         ) -> Iterator[tuple[str, str]]:
    """:func:`function_prompts` over installed packages (``(name, folder)`` pairs), labelled
    ``packages``."""
    return function_prompts(rng, "packages", packages) if packages else iter(())


# ---------------------------------------------------------------- procedural code requests

_ELEMS = ["integers", "floats", "strings", "words", "dates", "tuples of (name, score)",
          "dictionaries with 'name' and 'age' keys", "file paths", "email addresses", "prices"]
_LIST_OPS = [
    "returns the {k} largest values", "removes duplicates while keeping the original order",
    "groups the items by their first character", "returns the running total",
    "splits it into chunks of size {k}", "returns every {k}th element",
    "finds the most common item", "returns the items that appear exactly {k} times",
    "rotates it left by {k} positions", "returns pairs of adjacent items",
    "sorts it by length, then alphabetically", "counts how many items satisfy a predicate",
    "returns the longest increasing run", "merges it with a second sorted list",
    "flattens nested lists of any depth", "returns the median", "interleaves it with another list",
    "returns a histogram as a dictionary", "finds the two items whose sum is closest to {k}",
    "removes items that are falsy", "partitions it into two lists by a predicate",
]
_STRING_TASKS = [
    "counts the words in a sentence", "converts snake_case to camelCase",
    "checks whether two strings are anagrams", "reverses the order of words in a sentence",
    "compresses runs of repeated characters (aaabb -> a3b2)", "validates an IPv4 address",
    "extracts all hashtags from a tweet", "wraps text to {k} characters per line",
    "removes HTML tags from a string", "title-cases a sentence but keeps small words lowercase",
    "finds the longest common prefix of a list of strings", "converts a Roman numeral to an integer",
    "parses a query string into a dictionary", "masks all but the last {k} digits of a card number",
    "counts the frequency of each letter, ignoring case", "checks if brackets are balanced",
    "slugifies a title for a URL", "formats a number of seconds as HH:MM:SS",
    "finds all palindromic substrings of length at least {k}", "pads a string to width {k}",
    "parses a simple CSV line with quoted fields", "checks whether a password is strong",
]
_STRUCTURES = ["a stack", "a queue using two stacks", "an LRU cache with capacity {k}", "a trie",
               "a singly linked list with reverse()", "a binary search tree with insert and search",
               "a min-heap", "a circular buffer of size {k}", "a union-find structure",
               "a rate limiter allowing {k} calls per second", "a simple event emitter",
               "a priority queue with decrease-key", "a bloom filter", "an interval tree"]
_ALGOS = ["binary search", "merge sort", "quicksort", "breadth-first search on a grid",
          "Dijkstra's shortest path", "topological sort", "the sieve of Eratosthenes",
          "Kadane's maximum subarray", "the knapsack problem with dynamic programming",
          "edit distance", "flood fill", "matrix multiplication", "run-length decoding",
          "reservoir sampling", "the Fisher-Yates shuffle", "Euclid's algorithm",
          "depth-first search with cycle detection", "a sliding-window maximum"]
_TABLES = [("employees", ["id", "name", "department", "salary", "hire_date"]),
           ("orders", ["order_id", "customer_id", "amount", "status", "created_at"]),
           ("books", ["isbn", "title", "author", "year", "genre", "price"]),
           ("students", ["student_id", "name", "grade", "class", "score"]),
           ("flights", ["flight_no", "origin", "destination", "departure", "seats_free"]),
           ("products", ["sku", "name", "category", "stock", "unit_price"])]
_SQL_ASKS = ["the top {k} rows by {c}", "the average {c} per {g}", "rows where {c} is missing",
             "the number of rows per {g}, largest first", "duplicate values of {c}",
             "the second highest {c}", "each {g} with its maximum {c}",
             "rows added in the last {k} days", "a running total of {c} ordered by {c2}"]
_CONCEPTS = [("a list", "a tuple"), ("a process", "a thread"), ("TCP", "UDP"),
             ("== ", "is"), ("a shallow copy", "a deep copy"), ("an abstract class", "an interface"),
             ("git merge", "git rebase"), ("SQL", "NoSQL databases"), ("REST", "GraphQL"),
             ("a compiler", "an interpreter"), ("static typing", "dynamic typing"),
             ("async/await", "threads"), ("a stack", "a heap (memory)"),
             ("unit tests", "integration tests"), ("recursion", "iteration"),
             ("a class method", "a static method"), ("a generator", "a list comprehension"),
             ("HTTP GET", "HTTP POST"), ("inheritance", "composition"),
             ("optimistic locking", "pessimistic locking"), ("a hash map", "a tree map")]
_ERRORS = [
    ("TypeError: can only concatenate str (not \"int\") to str", "print('Total: ' + {k})"),
    ("IndexError: list index out of range", "items = [1, 2, 3]\nprint(items[{k}])"),
    ("KeyError: 'name'", "user = {{'id': {k}}}\nprint(user['name'])"),
    ("ZeroDivisionError: division by zero", "values = []\nmean = sum(values) / len(values)"),
    ("AttributeError: 'NoneType' object has no attribute 'strip'",
     "line = lines.get({k})\nprint(line.strip())"),
    ("UnboundLocalError: cannot access local variable 'count'",
     "count = {k}\ndef bump():\n    count += 1\nbump()"),
    ("ValueError: invalid literal for int() with base 10: 'abc'", "n = int(input())  # typed abc"),
    ("RecursionError: maximum recursion depth exceeded",
     "def fact(n):\n    return n * fact(n - 1)\nprint(fact({k}))"),
    ("ModuleNotFoundError: No module named 'requests'", "import requests"),
    ("TypeError: 'int' object is not iterable", "for i in {k}:\n    print(i)"),
]


def code_request(rng: random.Random) -> tuple[str, str]:
    """One composed programming request: ``(source, prompt)``."""
    k = rng.randint(2, 12)
    lang = rng.choice(["Python"] * 5 + LANGUAGES)
    form = rng.randrange(8)
    if form == 0:
        op = rng.choice(_LIST_OPS).format(k=k)
        return "gen.code.list", rng.choice([
            f"Write a {lang} function that takes a list of {rng.choice(_ELEMS)} and {op}.",
            f"In {lang}, how do I write a function that {op} for a list of {rng.choice(_ELEMS)}?",
            f"I have a list of {rng.choice(_ELEMS)}. Write {lang} code that {op}, with a short example."])
    if form == 1:
        task = rng.choice(_STRING_TASKS).format(k=k)
        return "gen.code.string", rng.choice([
            f"Write a {lang} function that {task}.", f"Show me {lang} code that {task}.",
            f"How can I write something in {lang} that {task}? Include tests."])
    if form == 2:
        structure = rng.choice(_STRUCTURES).format(k=k)
        return "gen.code.structure", rng.choice([
            f"Implement {structure} in {lang}.", f"Write a {lang} class for {structure}, with comments.",
            f"Explain how {structure} works and implement it in {lang}."])
    if form == 3:
        algo = rng.choice(_ALGOS)
        return "gen.code.algorithm", rng.choice([
            f"Implement {algo} in {lang} and explain its complexity.",
            f"Write {algo} in {lang}.", f"Explain {algo} with a {lang} example.",
            f"What is a common mistake when implementing {algo}? Show a correct {lang} version."])
    if form == 4:
        table, cols = rng.choice(_TABLES)
        c, c2, g = rng.sample(cols[1:], 3)
        ask = rng.choice(_SQL_ASKS).format(k=k, c=c, c2=c2, g=g)
        return "gen.code.sql", (f"A table `{table}` has columns {', '.join(cols)}. Write a SQL "
                                f"query that returns {ask}.")
    if form == 5:
        a, b = rng.choice(_CONCEPTS)
        return "gen.code.concept", rng.choice([
            f"What is the difference between {a} and {b}?", f"When should I use {a} instead of {b}?",
            f"Compare {a} and {b} with a short example."])
    if form == 6:
        error, snippet = rng.choice(_ERRORS)
        snippet = snippet.format(k=k)
        return "gen.code.error", rng.choice([
            f"I get `{error}` when I run this:\n\n{_block(snippet)}\n\nWhy, and how do I fix it?",
            f"Why does this Python code raise {error.split(':')[0]}?\n\n{_block(snippet)}"])
    tool = rng.choice(["bash", "a regular expression", "a Makefile rule", "a git command",
                       "a Dockerfile", "a cron expression", "awk"])
    goal = rng.choice(["finds all files larger than {k} MB", "matches dates like 2024-03-{k:02d}",
                       "runs the tests every {k} minutes", "undoes the last {k} commits but keeps the changes",
                       "counts lines in every .py file", "renames all .jpeg files to .jpg",
                       "extracts the {k}th column of a CSV file", "builds a small Python web app image"])
    return "gen.code.tooling", f"Write {tool} that {goal.format(k=k)}."


def generated_code_prompts(rng: random.Random) -> Iterator[tuple[str, str]]:
    while True:
        yield code_request(rng)
