"""Text prompts: open continuation (kind ``continuation``) and summarisation (``summarize``).

Real text comes from documentation that is installed with Python and with domino_jax's own
dependencies (so a build needs nothing else): ``pydoc_data.topics`` (the Python language
reference as plain text) and the docstrings and prose comment blocks of the CPython standard
library and of numpy, jax, flax, optax and orbax (parsed with :mod:`ast`, never imported). Docstrings are cut into
prose paragraphs (code examples, parameter tables and reST directives dropped). Each document
goes to exactly one of the two kinds (a seeded coin per document), so a continuation prompt
never quotes a passage that a summary prompt also shows. ``--text-dir`` adds the user's own
``.txt`` files (e.g. public-domain books) to the same pool.

Procedural sources complete the two kinds: story openings to continue and short synthetic
documents (emails, meeting notes, reviews, reports, dialogues) to summarise.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import random
import re
import sysconfig
from typing import Iterator

from domino_jax.train import corpus_parse
from domino_jax.train.corpus_code import python_files
from domino_jax.train.corpus_math import NAMES

DOC_PACKAGES = ("numpy", "jax", "flax", "optax", "orbax")
MIN_PARAGRAPH_WORDS = 18
MAX_PASSAGE_WORDS = 170
MIN_SUMMARY_WORDS = 35
# Google / numpy docstring section heads and "name: description" argument lines
_SECTION = re.compile(r"^(args|arguments|returns?|raises|yields|examples?|notes?|attributes|"
                      r"parameters|see also|warnings?|todo|references|keyword args)\s*(:|$)", re.I)
_ARG_LINE = re.compile(r"^\*{0,2}\w+(\s*\([^)]*\))?\s*:\s")


def prose_paragraphs(text: str) -> list[str]:
    """Paragraphs of ``text`` that read as prose, each joined to one line."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        lines = para.strip("\n").splitlines()
        if not lines or lines[0].startswith("   ") or "::=" in para:
            continue
        stripped = [line.strip() for line in lines]
        if _SECTION.match(stripped[0]) or sum(bool(_ARG_LINE.match(s)) for s in stripped) >= 2:
            continue
        if any(s.startswith((">>>", "...", "--", "==", "**", "..", ":", "|", "+-", "#"))
               for s in stripped):
            continue
        joined = " ".join(stripped)
        words = joined.split()
        if not MIN_PARAGRAPH_WORDS <= len(words) <= MAX_PASSAGE_WORDS:
            continue
        if sum(c.isalpha() or c == " " for c in joined) < 0.85 * len(joined):
            continue
        out.append(joined)
    return out


def package_root(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return list(spec.submodule_search_locations)[0]
    return os.path.dirname(spec.origin) if spec.origin else None


def _docstring_nodes(body) -> Iterator[ast.AST]:
    """Classes and functions among ``body``'s statements (recursing into compound statements,
    never into expressions)."""
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
            yield from _docstring_nodes(node.body)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.AST):
                    yield from _docstring_nodes(inner)


def comment_blocks(text: str) -> list[str]:
    """Runs of full-line ``#`` comments, joined into one paragraph each (licence headers,
    shebangs and commented-out code fall to :func:`prose_paragraphs`' checks)."""
    blocks, current = [], []
    for line in text.splitlines() + [""]:
        stripped = line.strip()
        if stripped.startswith("#") and not stripped.startswith("#!"):
            current.append(stripped.lstrip("#").strip())
        else:
            if current:
                blocks.append(" ".join(w for w in current if w))
            current = []
    return [b for b in blocks if not re.search(r"[=(){}\[\]]\s*$|copyright|licen[cs]e", b, re.I)]


def file_documents(path: str) -> list[list[str]]:
    """Prose paragraphs of each docstring (module, class, function) of one ``.py`` file,
    and its prose comment blocks as one more document ([] for a file that does not parse).
    The file is parsed once per process (:mod:`corpus_parse`)."""
    documents = corpus_parse.facts(path, "documents")
    return [] if documents is None else [list(d) for d in documents]


@corpus_parse.extractor("documents")
def _file_documents(text: str, tree: ast.Module) -> tuple[tuple[str, ...], ...]:
    """:func:`file_documents` of a file with this text and tree."""
    out = []
    for node in [tree, *_docstring_nodes(tree.body)]:
        doc = ast.get_docstring(node)
        paragraphs = prose_paragraphs(doc) if doc else []
        if paragraphs:
            out.append(tuple(paragraphs))
    comments = prose_paragraphs("\n\n".join(comment_blocks(text)))
    if comments:
        out.append(tuple(comments))
    return tuple(out)


class TextPool:
    """The text documents, parsed lazily and dealt to the two text kinds.

    Files (pydoc topics, the ``.py`` files of the stdlib and of ``packages``, the ``.txt``
    files of ``text_dir``) are shuffled by the seed and parsed one at a time when a kind
    needs a document; each document goes to ``continuation`` or ``summarize`` by a seeded
    coin drawn in file order (documents under ``MIN_SUMMARY_WORDS`` words always to
    continuation), so what each kind receives does not depend on which kind asked first. Labels: ``pydoc``, ``stdlib``, a package name, or ``textdir``.
    """

    def __init__(self, seed: int, packages=DOC_PACKAGES, text_dir: str | None = None,
                 summarize_share: float = 0.6):
        files: list[tuple[str, str]] = [("pydoc", key) for key in _pydoc_keys()]
        files += [("stdlib", p) for p in python_files(sysconfig.get_paths()["stdlib"])]
        for name in packages:
            root = package_root(name)
            if root is not None:
                files += [(name, p) for p in python_files(root)]
        if text_dir:
            if not os.path.isdir(text_dir):
                raise FileNotFoundError(f"--text-dir {text_dir!r} is not a directory")
            files += [("textdir", os.path.join(text_dir, f))
                      for f in sorted(os.listdir(text_dir)) if f.endswith(".txt")]
        random.Random(f"{seed}:text-files").shuffle(files)
        self._files = files[::-1]                    # popped from the end
        self._coin = random.Random(f"{seed}:text-docs")
        self._share = summarize_share
        self._ready: dict[str, list] = {"continuation": [], "summarize": []}
        self._seen: set[str] = set()                 # paragraphs already dealt (copies skipped)

    def _parse_next(self) -> None:
        label, path = self._files.pop()
        if label == "pydoc":
            import pydoc_data.topics
            docs = [prose_paragraphs(pydoc_data.topics.topics[path])]
        elif label == "textdir":
            with open(path, encoding="utf-8", errors="replace") as f:
                paragraphs = prose_paragraphs(f.read())
            docs = [paragraphs[i:i + 4] for i in range(0, len(paragraphs), 4)]
        else:
            docs = file_documents(path)
        for paragraphs in docs:
            paragraphs = [p for p in dict.fromkeys(paragraphs) if p not in self._seen]
            self._seen.update(paragraphs)
            if paragraphs:
                coin = self._coin.random()
                summarisable = sum(len(p.split()) for p in paragraphs) >= MIN_SUMMARY_WORDS
                kind = "summarize" if summarisable and coin < self._share else "continuation"
                self._ready[kind].append((label, paragraphs))

    def documents(self, kind: str) -> Iterator[tuple[str, list[str]]]:
        """``(label, paragraphs)`` for ``kind`` until every file is parsed."""
        ready = self._ready[kind]
        while True:
            while not ready and self._files:
                self._parse_next()
            if not ready:
                return
            yield ready.pop(0)


def _pydoc_keys() -> list[str]:
    import pydoc_data.topics
    return sorted(pydoc_data.topics.topics)


# ---------------------------------------------------------------- continuation

_CONTINUE_ASKS = [
    "Continue this text:", "Continue the following passage in the same style:",
    "Write the next few sentences of this paragraph:", "Finish this paragraph:",
    "Here is the start of a passage from a technical manual. Continue it:",
    "Carry on writing from where this leaves off:", "Complete the following text:",
    "Keep going with this explanation:",
]


def _prefix(paragraph: str, rng: random.Random) -> str | None:
    words = paragraph.split()
    cut = int(len(words) * rng.uniform(0.35, 0.65))
    if cut < 10:
        return None
    return " ".join(words[:cut])


def continuation_prompts(docs, rng: random.Random) -> Iterator[tuple[str, str]]:
    """One continuation prompt per paragraph: the paragraph cut at 35-65% of its words."""
    for label, paragraphs in docs:
        for paragraph in paragraphs:
            prefix = _prefix(paragraph, rng)
            if prefix is not None:
                yield f"docs.{label}.continue", f"{rng.choice(_CONTINUE_ASKS)}\n\n{prefix}"


_ROLES = ["lighthouse keeper", "retired detective", "young botanist", "street musician",
          "ship's cook", "night-shift nurse", "apprentice clockmaker", "mountain guide",
          "librarian", "beekeeper", "astronaut", "ferry captain", "pastry chef", "cartographer",
          "schoolteacher", "taxi driver", "archaeologist", "radio host", "blacksmith", "gardener",
          "violin repairer", "postwoman", "museum guard", "tailor", "zookeeper", "translator",
          "bus driver", "park ranger", "locksmith", "weather forecaster", "ice-cream seller"]
_ADJECTIVES = ["tired", "curious", "stubborn", "cheerful", "nervous", "quiet", "ambitious",
               "forgetful", "brave", "lonely", "meticulous", "restless"]
_SETTINGS = ["a fishing village", "a crowded night market", "an abandoned train station",
             "a research base in Antarctica", "a small bakery", "a city under heavy snow",
             "a desert town", "a floating city", "an old observatory", "a mountain monastery",
             "a rainy harbour", "a space station", "a vineyard at harvest time", "a border crossing",
             "a school on the last day of term", "a hospital at midnight", "a rooftop garden",
             "a village on stilts", "an island with one road", "a night train across the steppe",
             "a bookshop that never closes", "a town where it always rains on Tuesdays",
             "a circus in winter quarters", "a lighthouse that no ship uses any more"]
_EVENTS = ["found a letter addressed to someone who had died fifty years earlier",
           "heard a knock at the door long after the last visitor had gone",
           "noticed that every clock in the building had stopped at the same minute",
           "received a package with no return address", "saw a light where no light should be",
           "realised the map in the drawer showed a street that did not exist",
           "was offered a job that seemed too good to be true",
           "discovered a door that had not been there the day before",
           "met a stranger who knew their name", "lost the only key to the archive",
           "watched the tide go out and not come back", "answered a phone that never rang",
           "found their own handwriting in a book they had never read",
           "inherited a house from a great-aunt nobody had mentioned",
           "was the only person who remembered yesterday", "won a prize for a contest they never entered",
           "heard music coming from the empty flat upstairs", "caught a pigeon carrying a message"]
_STORY_ASKS = ["Continue this story:", "What happens next? Continue the story.",
               "Write the next paragraph of this story:", "Continue this story in about 150 words:",
               "Keep the story going, in the same voice:", "Finish this short story:"]
_SENTENCE_STARTS = ["The best thing about {t} is", "Nobody expected that {t} would",
                    "If I could change one thing about {t}, it would be",
                    "The first time I tried {t},", "Most people misunderstand {t} because",
                    "In a hundred years, {t} will"]
_PLAIN_TOPICS = ["cooking", "public transport", "learning a language", "working from home",
                 "gardening", "video games", "long walks", "social media", "libraries", "chess",
                 "camping", "jazz", "electric cars", "homework", "rainy days", "city life",
                 "online shopping", "old photographs", "birthdays", "running", "painting"]


def story_prompt(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.25:
        start = rng.choice(_SENTENCE_STARTS).format(t=rng.choice(_PLAIN_TOPICS))
        return "gen.continue.sentence", rng.choice([
            f"Complete this sentence and write a short paragraph after it: \"{start} ...\"",
            f"Continue: {start}"])
    name, adjective = rng.choice(NAMES), rng.choice(_ADJECTIVES)
    article = "an" if adjective[0] in "aeiou" else "a"
    opening = (f"{name}, {article} {adjective} {rng.choice(_ROLES)} in "
               f"{rng.choice(_SETTINGS)}, {rng.choice(_EVENTS)}.")
    second = rng.choice(["", " It was the third time that week.", f" {name} told no one.",
                         " The wind had dropped, and the street was silent.",
                         " At first it seemed like nothing.", " That was how it began.",
                         " Nobody believed it, of course.", f" {name} decided to find out why.",
                         " It was the last thing anyone expected that spring.",
                         " By morning, the whole town knew."])
    return "gen.continue.story", f"{rng.choice(_STORY_ASKS)}\n\n{opening}{second}"


def story_prompts(rng: random.Random) -> Iterator[tuple[str, str]]:
    while True:
        yield story_prompt(rng)


# ---------------------------------------------------------------- summarisation

_SUMMARY_ASKS = [
    "Summarise the following passage in two sentences.", "Give me a one-sentence summary:",
    "TL;DR this for me:", "What are the key points of this text? Use bullet points.",
    "Explain this passage in plain English.", "What is the main idea of the text below?",
    "Summarise this for a beginner:", "Condense this into a short paragraph:",
    "Write a one-line summary of this documentation:",
]


def summary_passages(docs, rng: random.Random) -> Iterator[tuple[str, str]]:
    """Consecutive paragraphs of one document merged to 35-170 words, then asked about."""
    for label, paragraphs in docs:
        current: list[str] = []
        for paragraph in paragraphs + [None]:
            size = sum(len(p.split()) for p in current)
            if paragraph is None or size + len(paragraph.split()) > MAX_PASSAGE_WORDS:
                if size >= MIN_SUMMARY_WORDS:
                    ask = rng.choice(_SUMMARY_ASKS)
                    yield f"docs.{label}.summarize", f"{ask}\n\n" + "\n\n".join(current)
                current = []
            if paragraph is not None:
                current.append(paragraph)


_TEAMS = ["design", "finance", "support", "marketing", "platform", "research", "sales", "events"]
_PROJECTS = ["the new mobile app", "the office move", "the spring newsletter", "the data migration",
             "the community fair", "the website redesign", "the onboarding guide", "the Q3 budget",
             "the customer survey", "the warehouse upgrade", "the charity run", "the API launch"]
_ISSUES = ["the vendor delivered late", "two people are on leave", "the budget was cut by {p}%",
           "the test results came back mixed", "a key requirement changed",
           "the venue cancelled", "customers reported slow load times", "the printer broke again"]
_DECISIONS = ["push the deadline back by {n} days", "hire a contractor", "split the work into two phases",
              "ask legal for a review", "run a small pilot first", "drop the least-used feature",
              "move the meeting to Thursdays", "double the testing time"]
_PRODUCTS = ["blender", "pair of running shoes", "standing desk", "e-reader", "coffee grinder",
             "backpack", "electric kettle", "wireless keyboard", "tent", "air purifier"]
_PROS = ["it is quiet", "the battery lasts for days", "setup took five minutes", "it feels sturdy",
         "the price was fair", "it looks great", "it is light enough to carry everywhere"]
_CONS = ["the manual is confusing", "the lid is hard to clean", "it arrived scratched",
         "the app keeps logging me out", "it is louder than expected", "the cable is short"]


def synthetic_document(rng: random.Random) -> tuple[str, str]:
    """A short composed document and a request to summarise it: ``(source, prompt)``."""
    a, b, c = rng.sample(NAMES, 3)
    p, n = rng.randint(5, 30), rng.randint(2, 21)
    project = rng.choice(_PROJECTS)
    issue = rng.choice(_ISSUES).format(p=p)
    decision = rng.choice(_DECISIONS).format(n=n)
    form = rng.randrange(5)
    if form == 0:
        doc = (f"Hi {b},\n\nQuick update on {project}: {issue}, so we are about {n} days "
               f"behind. {c} suggested that we {decision}. I think that is reasonable, but "
               f"I would like the {rng.choice(_TEAMS)} team to weigh in before Friday. Could "
               f"you also check whether {rng.choice(_PROJECTS)} is affected?\n\nThanks,\n{a}")
        source, ask = "gen.summarize.email", rng.choice(
            ["Summarise this email in one sentence.", "What is this email asking for?",
             "Write a two-line summary of this email and list any action items."])
    elif form == 1:
        doc = (f"Meeting notes ({rng.choice(_TEAMS)} team)\nAttendees: {a}, {b}, {c}\n"
               f"- Status of {project}: {issue}.\n- {b} proposed to {decision}; agreed.\n"
               f"- {c} will send the revised plan by {rng.choice(['Monday', 'Wednesday', 'the end of the month'])}.\n"
               f"- Open question: who owns {rng.choice(_PROJECTS)}?")
        source, ask = "gen.summarize.meeting", rng.choice(
            ["Summarise these meeting notes.", "Turn these notes into a short summary paragraph.",
             "What was decided in this meeting, and who does what next?"])
    elif form == 2:
        product = rng.choice(_PRODUCTS)
        pros, cons = rng.sample(_PROS, 2), rng.sample(_CONS, 1 + rng.randrange(2))
        stars = rng.randint(2, 5)
        doc = (f"{stars}/5. I bought this {product} {n} weeks ago. {pros[0].capitalize()} and "
               f"{pros[1]}. On the other hand, {' and '.join(cons)}. "
               f"{'I would buy it again.' if stars >= 4 else 'I am not sure I would recommend it.'}")
        source, ask = "gen.summarize.review", rng.choice(
            ["Summarise this product review.", "Is this review positive or negative? Summarise why.",
             "List the pros and cons mentioned in this review."])
    elif form == 3:
        months = rng.sample(["January", "February", "March", "April", "May", "June", "July"], 3)
        values = [rng.randint(50, 400) for _ in months]
        rows = "\n".join(f"{m}: {v} units" for m, v in zip(months, values))
        doc = f"Monthly sales of the {rng.choice(_PRODUCTS)}:\n{rows}\nReturns: {p}% of units."
        source, ask = "gen.summarize.data", rng.choice(
            ["Summarise the trend in this data.", "Describe these figures in two sentences.",
             "What stands out in this data?"])
    else:
        doc = (f"{a}: Did you see that {issue}?\n{b}: Yes. I think we should {decision}.\n"
               f"{a}: That could work, but what about {project}?\n"
               f"{b}: {c} is handling it. Let's talk to them tomorrow.")
        source, ask = "gen.summarize.dialogue", rng.choice(
            ["Summarise this conversation.", "What did the two people agree on?",
             "Write a one-sentence summary of this chat."])
    return source, f"{ask}\n\n{doc}"


def synthetic_documents(rng: random.Random) -> Iterator[tuple[str, str]]:
    while True:
        yield synthetic_document(rng)
