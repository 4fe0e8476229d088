"""Normalisation, exact and near-duplicate removal, and benchmark exclusion for the corpus.

* :func:`normalise` / :func:`prompt_id`: NFKC, lower case, one space between words; the id
  is the first 16 hex digits of the sha256 of the normalised text (exact duplicates share it).
* :class:`NearDuplicateIndex`: word 5-gram shingles, a 100-value MinHash signature, LSH in
  20 bands of 5 rows, candidates confirmed with the *exact* shingle Jaccard; a prompt whose
  Jaccard with any kept prompt is >= ``threshold`` (default 0.8) is a near-duplicate.
  Streaming and greedy (the first of a near-duplicate pair is kept).
* :class:`BenchmarkFilter`: drops prompts that share a word ``n``-gram (default 8) with any
  text of the ``--exclude`` files, or that contain a fingerprint of a public benchmark item
  (:data:`BENCHMARK_FINGERPRINTS`). Fingerprints match on the word sequence of the normalised
  text, so punctuation, ``$`` and case do not matter.

Hashes are stable across processes and machines (crc32 per word, splitmix64 mixing; never
Python's salted ``hash``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import unicodedata
import zlib
from typing import Iterable, Iterator, Sequence

import numpy as np

_WORD = re.compile(r"\w+")
_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"',
                         "\u2013": "-", "\u2014": "-"})


def normalise(text: str) -> str:
    """NFKC, typographic quotes/dashes to ASCII, lower case, whitespace runs to one space."""
    text = unicodedata.normalize("NFKC", text)
    if not text.isascii():                   # the quotes and dashes to map are not ASCII
        text = text.translate(_QUOTES)
    return " ".join(text.lower().split())


def prompt_id(text: str) -> str:
    """16 hex digits: sha256 of :func:`normalise` (text)."""
    return normalised_id(normalise(text))


def normalised_id(normalised: str) -> str:
    """:func:`prompt_id` of a text whose :func:`normalise` is ``normalised``."""
    return hashlib.sha256(normalised.encode("utf-8")).hexdigest()[:16]


def words_of(normalised: str) -> list[str]:
    return _WORD.findall(normalised)


class _WordHashes(dict):
    """word -> its stable hash (crc32 + 1), computed on first look-up and kept."""

    def __missing__(self, word: str) -> int:
        h = self[word] = zlib.crc32(word.encode("utf-8")) + 1
        return h


_WORD_IDS = _WordHashes()


def word_hashes(words: Sequence[str]) -> np.ndarray:
    """``uint64 [len(words)]`` stable per-word hashes (crc32, cached)."""
    return np.fromiter(map(_WORD_IDS.__getitem__, words), np.uint64, len(words))


_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64_inplace(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser (wrapping arithmetic) written over ``x``, a uint64 array the
    caller owns; returns ``x``."""
    x ^= x >> _S30
    x *= _MIX1
    x ^= x >> _S27
    x *= _MIX2
    x ^= x >> _S31
    return x


def ngram_hashes(hashes: np.ndarray, n: int) -> np.ndarray:
    """``uint64 [len - n + 1]`` hashes of the word ``n``-grams (one hash of all words if
    there are fewer than ``n``; empty for no words)."""
    if len(hashes) == 0:
        return hashes
    n = min(n, len(hashes))
    m = len(hashes) - n + 1
    out = _mix64_inplace(hashes[:m].copy())
    for j in range(1, n):
        out *= _GOLDEN
        out += hashes[j:j + m]
        _mix64_inplace(out)
    return out


class NearDuplicateIndex:
    """Greedy streaming near-duplicate filter (MinHash LSH + exact Jaccard check).

    ``add(text)`` returns the index of the kept prompt it duplicates (Jaccard of word
    ``shingle``-gram sets >= ``threshold``), or None after adding it. ``query`` only looks.
    """

    def __init__(self, threshold: float = 0.8, shingle: int = 5, bands: int = 20, rows: int = 5,
                 seed: int = 0x5EED):
        self.threshold, self.shingle, self.bands, self.rows = threshold, shingle, bands, rows
        rng = np.random.default_rng(seed)
        self._seeds = rng.integers(0, 2 ** 63, size=bands * rows, dtype=np.uint64)
        # band -> {band key: the kept prompts with that key, in the order they were kept}: an
        # int for a single prompt (most keys), a list from the second on (fewer objects
        # for the garbage collector to walk)
        self._buckets: list[dict[bytes, int | list[int]]] = [{} for _ in range(bands)]
        self._shingles: list[np.ndarray] = []

    def __len__(self) -> int:
        return len(self._shingles)

    def shingles(self, text: str) -> np.ndarray:
        """Sorted unique shingle hashes of ``text``."""
        return self.shingles_of_words(words_of(normalise(text)))

    def shingles_of_words(self, words: Sequence[str]) -> np.ndarray:
        """:meth:`shingles` of a text whose normalised words are ``words``."""
        return np.unique(ngram_hashes(word_hashes(words), self.shingle))

    def _signature(self, shingles: np.ndarray) -> np.ndarray:
        if len(shingles) == 0:
            return np.zeros(len(self._seeds), np.uint64)
        return _mix64_inplace(shingles[:, None] ^ self._seeds[None, :]).min(axis=0)

    def _band_keys(self, signature: np.ndarray) -> list[bytes]:
        raw, width = signature.tobytes(), self.rows * signature.itemsize
        return [raw[b * width:(b + 1) * width] for b in range(self.bands)]

    def _match(self, shingles: np.ndarray, keys: list[bytes]) -> int | None:
        seen: set[int] = set()
        for bucket, key in zip(self._buckets, keys):
            kept = bucket.get(key)
            if kept is None:
                continue
            for j in kept if isinstance(kept, list) else (kept,):
                if j in seen:
                    continue
                seen.add(j)
                if jaccard(shingles, self._shingles[j]) >= self.threshold:
                    return j
        return None

    def query(self, text: str) -> int | None:
        shingles = self.shingles(text)
        return self._match(shingles, self._band_keys(self._signature(shingles)))

    def add(self, text: str) -> int | None:
        return self.add_words(words_of(normalise(text)))

    def add_words(self, words: Sequence[str]) -> int | None:
        """:meth:`add` for a text whose normalised words are ``words``."""
        shingles = self.shingles_of_words(words)
        keys = self._band_keys(self._signature(shingles))
        match = self._match(shingles, keys)
        if match is None:
            index = len(self._shingles)
            self._shingles.append(shingles)
            for bucket, key in zip(self._buckets, keys):
                kept = bucket.get(key)
                if kept is None:
                    bucket[key] = index
                elif isinstance(kept, list):
                    kept.append(index)
                else:
                    bucket[key] = [kept, index]
        return match


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard similarity of two sorted unique uint64 arrays (1.0 for two empty sets)."""
    if len(a) == 0 and len(b) == 0:
        return 1.0
    if len(a) > len(b):
        a, b = b, a
    inter = 0
    if len(a):                               # each of a's values looked up among b's
        at = np.searchsorted(b, a)
        at[at == len(b)] = 0
        inter = int(np.count_nonzero(b[at] == a))
    return inter / (len(a) + len(b) - inter)


# ---------------------------------------------------------------- benchmark exclusion

BENCHMARK_FINGERPRINTS: dict[str, list[str]] = {
    # HumanEval: entry points / signatures of its problems (distinctive names only bare;
    # generic names with their HumanEval signature).
    "humaneval": [
        "def has_close_elements(", "def separate_paren_groups(", "def truncate_number(",
        "def below_zero(operations", "def mean_absolute_deviation(", "def intersperse(",
        "def parse_nested_parens(", "def filter_by_substring(", "def sum_product(numbers",
        "def rolling_max(", "def make_palindrome(", "def string_xor(",
        "def greatest_common_divisor(", "def all_prefixes(", "def string_sequence(",
        "def count_distinct_characters(", "def parse_music(", "def how_many_times(",
        "def sort_numbers(numbers: str", "def find_closest_elements(", "def rescale_to_unit(",
        "def filter_integers(", "def largest_divisor(", "def flip_case(", "def filter_by_prefix(",
        "def get_positive(l: list", "def find_zero(xs", "def sort_third(", "def max_element(l: list",
        "def sort_even(l: list", "def decode_cyclic(", "def prime_fib(", "def triples_sum_to_zero(",
        "def car_race_collision(", "def incr_list(", "def pairs_sum_to_zero(", "def change_base(x: int",
        "def fib4(", "def modp(n: int", "def decode_shift(", "def remove_vowels(text",
        "def below_threshold(", "def add(x: int, y: int)", "def same_chars(", "def fib(n: int)",
        "def correct_bracketing(brackets", "def monotonic(l: list", "def common(l1: list",
        "def largest_prime_factor(", "def sum_to_n(", "def derivative(xs: list", "def fibfib(",
        "def vowels_count(", "def circular_shift(x, shift", "def digitsum(s", "def fruit_distribution(",
        "def pluck(arr", "def strange_sort_list(", "def will_it_fly(", "def smallest_change(arr",
        "def total_match(lst1", "def is_multiply_prime(", "def is_simple_power(", "def iscube(",
        "def hex_key(num", "def decimal_to_binary(decimal", "def is_happy(s", "def numerical_letter_grade(",
        "def prime_length(string", "def starts_one_ends(", "def anti_shuffle(", "def get_row(lst, x",
        "def next_smallest(lst", "def is_bored(", "def any_int(x, y, z", "def count_upper(s",
        "def closest_integer(value", "def make_a_pile(", "def words_string(s", "def choose_num(x, y",
        "def rounded_avg(", "def unique_digits(x", "def by_length(arr", "def even_odd_palindrome(",
        "def count_nums(arr", "def move_one_ball(", "def reverse_delete(", "def odd_count(lst",
        "def minsubarraysum(", "def max_fill(grid", "def select_words(s, n", "def get_closest_vowel(",
        "def match_parens(lst", "def add_elements(arr, k", "def get_odd_collatz(", "def valid_date(date",
        "def split_words(txt", "def prod_signs(", "def minpath(grid", "def is_nested(string",
        "def check_if_last_char_is_a_letter(", "def can_arrange(arr", "def largest_smallest_integers(",
        "def compare_one(a, b", "def is_equal_to_sum_even(", "def special_factorial(", "def fix_spaces(",
        "def file_name_check(", "def words_in_sentence(", "def order_by_points(", "def specialfilter(",
        "def get_max_triples(", "def sorted_list_sum(", "def x_or_y(n, x, y", "def double_the_difference(",
        "def strongest_extension(", "def cycpattern_check(", "def even_odd_count(", "def int_to_mini_roman(",
        "def right_angle_triangle(", "def find_max(words", "def eat(number, need, remaining",
        "def do_algebra(operator", "def string_to_md5(", "def generate_integers(a, b",
        "check if in given list of numbers, are any two numbers closer to each other than given threshold",
    ],
    # MBPP: function names of its problems.
    "mbpp": [
        "def min_cost(cost, m, n", "def similar_elements(", "def is_not_prime(", "def heap_queue_largest(",
        "def count_ways(n", "def differ_at_one_bit_pos(", "def find_char_long(", "def square_nums(",
        "def find_rotations(", "def small_nnum(", "def remove_occ(", "def sort_matrix(",
        "def count_common(words", "def find_volume(l, b, h", "def split_lowerstring(",
        "def text_lowercase_underscore(", "def square_perimeter(", "def remove_dirty_chars(",
        "def test_duplicate(", "def is_woodall(", "def multiples_of_num(", "def find_first_duplicate(",
        "write a function to find the minimum cost path to reach (m, n) from (0, 0)",
        "write a function to find the shared elements from the given two lists",
        "write a python function to remove first and last occurrence of a given character",
    ],
    # GSM8K (test and train): openings of well-known problems.
    "gsm8k": [
        "janet's ducks lay 16 eggs per day", "a robe takes 2 bolts of blue fiber",
        "josh decides to try flipping a house", "james decides to run 3 sprints 3 times a week",
        "every day wendi feeds each of her chickens", "kylar went to the store to buy glasses",
        "toulouse has twice as many sheep as charleston", "carla is downloading a 200 gb file",
        "john drives for 3 hours at a speed of 60 mph", "eliza's rate per hour for the first 40 hours",
        "natalia sold clips to 48 of her friends in april", "weng earns $12 an hour for babysitting",
        "betty is saving money for a new wallet which costs $100",
        "julie is reading a 120-page book", "mark has a garden with flowers",
    ],
    # MATH / MATH-500 and AIME: problem openings.
    "math": [
        "how many vertical asymptotes does the graph of", "convert the point (0,3) in rectangular coordinates",
        "define p = sum_{k = 1}^\\infty", "what is the positive difference between 120% of 30 and 130% of 20",
        "if f(x) = \\frac{3x-2}{x-2}, what is the value of f(-2) +f(-1)+f(0)",
    ],
    "aime": [
        "every morning aya goes for a", "alice and bob play the following game. a stack of n tokens",
        "jen enters a lottery by picking", "there exist real numbers x and y, both greater than 1, such that",
        "call a positive integer n b-eautiful", "let b\\geq 2 be an integer",
    ],
    # MT-Bench: question openings.
    "mt_bench": [
        "compose an engaging travel blog post about a recent trip to hawaii",
        "draft a professional email seeking your supervisor's feedback on the 'quarterly financial report'",
        "imagine you are writing a blog post comparing two popular smartphone models",
        "write a persuasive email to convince your introverted friend",
        "describe a vivid and unique character, using strong imagery",
        "could you write a captivating short story beginning with the sentence",
        "craft an intriguing opening paragraph for a fictional short story",
        "help me construct a catchy, yet scientifically accurate, headline",
        "pretend yourself to be elon musk", "embrace the role of sheldon from",
        "imagine yourself as a doctor tasked with devising innovative remedies",
        "please take on the role of a relationship coach",
        "picture yourself as a 100-years-old tree", "if you have just overtaken the second person",
        "thomas is very healthy, but he has to go to the hospital every day",
        "david has three sisters. each of them has one brother",
        "the vertices of a triangle are at points (0, 0), (-1, 1), and (3, 3)",
        "a tech startup invests $8000 in software development",
        "when a number is divided by 10, the remainder is 4",
        "develop a python program that reads all the text files under a directory",
        "write a c++ program to find the nth fibonacci number using recursion",
        "implement a program to find the common elements in two arrays without using any extra data structures",
    ],
    # AlpacaEval: well-known instructions.
    "alpaca_eval": [
        "what are the names of some famous actors that started their careers on broadway",
        "how did us states get their names", "my sister and her girlfriends want me to play kickball",
        "what is some cool music from the 1920s", "how do i wrap a present neatly",
        "how do i dice without slicing my finger", "i'm trying to solve a crossword puzzle, but i've never done one",
        "can you give me a recipe for koldskål", "i am gathering recipes of different dishes and drinks",
    ],
    # LiveCodeBench (LeetCode / AtCoder / Codeforces style contest statements).
    "livecodebench": ["takahashi and aoki", "you are given a 0-indexed integer array nums",
                      "you are given a 0-indexed string s", "you are given a 1-indexed integer array"],
}


def _fingerprint_words(phrase: str) -> tuple[str, ...]:
    return tuple(words_of(normalise(phrase)))


def iter_jsonl(path: str) -> Iterator[tuple[int, object]]:
    """``(line number, value)`` for each non-empty line of a JSON-lines file; a bad line
    raises ``ValueError`` naming ``path:line``."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield number, json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{number}: not valid JSON ({e})") from e


def read_exclude_file(path: str) -> list[str]:
    """Texts of one ``--exclude`` file: ``.jsonl`` (every string value of every object, lists
    of strings included) or plain text (one text per non-empty line)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--exclude file {path!r} not found")
    if path.endswith(".jsonl"):
        return [text for _, record in iter_jsonl(path) for text in _strings_in(record)]
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def _strings_in(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings_in(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings_in(v)]
    return []


class BenchmarkFilter:
    """``reason(text)`` -> why ``text`` must be excluded (``"fingerprint:<benchmark>"`` or
    ``"exclude:<file>"``), or None.

    An exclude text with fewer than ``ngram`` words (but at least ``min_words``) is matched
    as a whole word sequence; shorter ones are ignored (counted in ``ignored_short``).
    """

    def __init__(self, exclude_files: Iterable[str] = (), ngram: int = 8, min_words: int = 4,
                 fingerprints: dict[str, list[str]] | None = None):
        self.ngram, self.ignored_short = ngram, 0
        self.files: list[dict] = []
        self._exclude: dict[int, dict[int, str]] = {}      # length -> {gram hash: file}
        for path in exclude_files:
            texts = read_exclude_file(path)
            grams = 0
            for text in texts:
                hashes = word_hashes(words_of(normalise(text)))
                if len(hashes) < min_words:
                    self.ignored_short += 1
                    continue
                n = min(ngram, len(hashes))
                table = self._exclude.setdefault(n, {})
                for h in ngram_hashes(hashes, n).tolist():
                    table.setdefault(h, path)
                    grams += 1
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            self.files.append({"path": path, "texts": len(texts), "ngrams": grams,
                               "sha256": digest})
        fingerprints = BENCHMARK_FINGERPRINTS if fingerprints is None else fingerprints
        self._anchors: dict[tuple[str, str], list[tuple[tuple[str, ...], str]]] = {}
        for bench, phrases in fingerprints.items():
            for phrase in phrases:
                fp = _fingerprint_words(phrase)
                if len(fp) < 2:
                    raise ValueError(f"fingerprint {phrase!r} ({bench}) needs at least two words")
                self._anchors.setdefault(fp[:2], []).append((fp, bench))

    def reason(self, text: str) -> str | None:
        return self.reason_words(words_of(normalise(text)))

    def reason_words(self, words: Sequence[str]) -> str | None:
        """:meth:`reason` for a text whose normalised words are ``words``."""
        if self._anchors:
            joined = None
            for bigram in set(zip(words, words[1:])) & self._anchors.keys():
                joined = joined or f" {' '.join(words)} "
                for fp, bench in self._anchors[bigram]:
                    if f" {' '.join(fp)} " in joined:
                        return f"fingerprint:{bench}"
        if self._exclude:
            hashes = word_hashes(words)
            for n, table in self._exclude.items():
                if len(hashes) < n:
                    continue
                for h in ngram_hashes(hashes, n).tolist():
                    if h in table:
                        return f"exclude:{table[h]}"
        return None
