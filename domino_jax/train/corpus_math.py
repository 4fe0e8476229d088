"""Procedural reasoning and math prompts (kind ``math``) for the prompt corpus.

Each family is a function ``(rng: random.Random) -> str`` that writes one problem with
fresh numbers, names and objects and one of several phrasings; :data:`MATH_FAMILIES` lists
them with their mixing weights. Nothing here is copied from a benchmark: every problem is
composed from the word lists below (the corpus builder still screens every prompt against
benchmark fingerprints, see :mod:`domino_jax.train.corpus_dedup`).
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

NAMES = [
    "Amara", "Ben", "Carlos", "Dana", "Elif", "Farid", "Grace", "Hiro", "Ines", "Jonas",
    "Keiko", "Liam", "Mei", "Nadia", "Oscar", "Priya", "Quentin", "Rosa", "Sanjay", "Tara",
    "Umar", "Vera", "Wen", "Ximena", "Yusuf", "Zoe", "Aiden", "Bianca", "Chidi", "Delia",
    "Emeka", "Freya", "Gustavo", "Hana", "Ivan", "Jamila", "Kofi", "Lucia", "Mateo", "Noor",
    "Olga", "Pablo", "Rania", "Soren", "Tomas", "Uma", "Viktor", "Willa", "Yara", "Zane",
    "Anika", "Bruno", "Camille", "Diego", "Esther", "Felix", "Gita", "Hugo", "Ayla", "Ravi",
]
ITEMS = [
    "apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "seashells",
    "postcards", "cupcakes", "tomatoes", "bottles of juice", "notebooks", "candles", "bricks",
    "tulip bulbs", "trading cards", "buttons", "muffins", "oranges", "comic books", "paper cranes",
    "jars of honey", "socks", "badges", "beads", "puzzle pieces", "rolls of tape", "plums",
]
SHOPS = ["bakery", "bookshop", "hardware store", "farmers' market stall", "stationery shop",
         "garden centre", "corner shop", "toy store", "café", "flower stand"]
VEHICLES = ["train", "bus", "cyclist", "car", "ferry", "delivery van", "runner", "truck"]
JOBS = ["paint a fence", "fill a pool", "type a report", "assemble the shelves",
        "mow the lawn", "pack the boxes", "clean the hall", "sort the mail"]
SUFFIXES = ["", "", " Show your work.", " Explain your reasoning step by step.",
            " Think it through before answering.", " Give the final answer at the end.",
            " Please explain each step.", " Walk me through the solution.",
            " What is the answer, and how did you get it?"]


def _pick_names(rng: random.Random, n: int) -> list[str]:
    return rng.sample(NAMES, n)


def _money(value: float) -> str:
    return f"${value:,.2f}" if value != int(value) else f"${int(value):,}"


def _ask(rng: random.Random, question: str) -> str:
    return question + rng.choice(SUFFIXES)


# ---------------------------------------------------------------- arithmetic word problems

def shopping(rng: random.Random) -> str:
    a, b = _pick_names(rng, 2)
    item, other = rng.sample(ITEMS, 2)
    n1, n2 = rng.randint(2, 12), rng.randint(2, 9)
    p1, p2 = rng.choice([0.5, 0.75, 1.25, 2, 3, 4.5, 6]), rng.choice([1, 1.5, 2.25, 5, 8])
    paid = math.ceil((n1 * p1 + n2 * p2) / 10) * 10 + rng.choice([0, 10, 20])
    forms = [
        f"{a} buys {n1} {item} at {_money(p1)} each and {n2} {other} at {_money(p2)} each, "
        f"paying with {_money(paid)}. How much change should {a} get?",
        f"At the {rng.choice(SHOPS)}, {item} cost {_money(p1)} apiece and {other} cost "
        f"{_money(p2)} apiece. If {a} picks up {n1} {item} and {n2} {other}, what is the bill?",
        f"{a} and {b} split the cost of {n1} {item} ({_money(p1)} each) and {n2} {other} "
        f"({_money(p2)} each) equally. How much does each of them pay?",
    ]
    return _ask(rng, rng.choice(forms))


def collection(rng: random.Random) -> str:
    a, b, c = _pick_names(rng, 3)
    item = rng.choice(ITEMS)
    start, k, give, more = rng.randint(10, 90), rng.randint(2, 5), rng.randint(1, 9), rng.randint(3, 25)
    forms = [
        f"{a} had {start} {item}. {b} gave {a} {more} more, and then {a} handed {give} to {c}. "
        f"How many {item} does {a} have left?",
        f"{b} has {k} times as many {item} as {a}, who has {start}. {c} has {more} fewer than "
        f"{b}. How many {item} do the three have together?",
        f"{a} collects {item}. On Monday the collection had {start}; each day after that "
        f"{a} added {k}, for {give + 2} days. How many are in the collection now?",
        f"{a} shares {start * k} {item} equally among {k} friends, then each friend gives "
        f"{min(give, start)} back. How many {item} does {a} end up with?",
    ]
    return _ask(rng, rng.choice(forms))


def rates(rng: random.Random) -> str:
    vehicle = rng.choice(VEHICLES)
    speed, hours, speed2 = rng.randint(8, 120), rng.choice([1.5, 2, 2.5, 3, 4, 0.75]), rng.randint(5, 90)
    dist = rng.randint(20, 600)
    forms = [
        f"A {vehicle} travels at {speed} km/h for {hours} hours. How far does it go?",
        f"A {vehicle} covers {dist} km in {hours} hours. What is its average speed?",
        f"Two {vehicle}s leave towns {dist} km apart at the same time and head towards each "
        f"other at {speed} km/h and {speed2} km/h. When do they meet?",
        f"A {vehicle} goes {dist} miles at {speed} mph and returns at {speed2} mph. What is "
        "the average speed for the whole round trip?",
        f"How long does it take to travel {dist} km at an average of {speed} km/h? Give the "
        "answer in hours and minutes.",
    ]
    return _ask(rng, rng.choice(forms))


def work_rate(rng: random.Random) -> str:
    a, b = _pick_names(rng, 2)
    job = rng.choice(JOBS)
    ta, tb = rng.randint(2, 12), rng.randint(3, 15)
    forms = [
        f"{a} can {job} in {ta} hours and {b} can do it in {tb} hours. Working together, how "
        "long will it take them?",
        f"One machine can {job} in {ta} hours; a second can do it in {tb} hours. If both run "
        "together, what fraction of the job is done after one hour?",
        f"{a} and {b} together {job} in {ta} hours. {a} alone needs {ta + tb} hours. How long "
        f"would {b} need alone?",
    ]
    return _ask(rng, rng.choice(forms))


def percentages(rng: random.Random) -> str:
    a = rng.choice(NAMES)
    p, q = rng.choice([5, 10, 12, 15, 20, 25, 30, 35, 40, 60, 75]), rng.randint(2, 45)
    price = rng.choice([18, 24, 40, 55, 80, 120, 250, 399, 1200])
    old, new = rng.randint(20, 500), rng.randint(20, 500)
    forms = [
        f"What is {p}% of {price}?",
        f"A jacket costs {_money(price)} and is on sale for {p}% off. What is the sale price?",
        f"A price rises from {_money(old)} to {_money(new)}. What is the percentage change?",
        f"{a} leaves a {q}% tip on a {_money(price)} restaurant bill. How much is the tip and "
        "the total?",
        f"After a {p}% discount and then {q}% sales tax, how much does an item originally "
        f"priced at {_money(price)} cost?",
        f"{old} is what percent of {old + new}?",
        f"A town had {old * 100:,} residents. The population grew by {q}% and then fell by "
        f"{p}%. How many residents are there now?",
        f"If {p}% of a number is {q * 3}, what is the number?",
    ]
    return _ask(rng, rng.choice(forms))


def interest(rng: random.Random) -> str:
    principal = rng.choice([500, 1000, 2500, 4000, 10000, 15000])
    rate, years = rng.choice([2, 3, 3.5, 4, 5, 6, 8]), rng.randint(2, 10)
    forms = [
        f"{_money(principal)} is invested at {rate}% simple interest per year. How much "
        f"interest is earned after {years} years?",
        f"How much will {_money(principal)} grow to in {years} years at {rate}% interest "
        "compounded annually?",
        f"A loan of {_money(principal)} charges {rate}% per year compounded monthly. What is "
        f"owed after {years} years if nothing is repaid?",
        f"Roughly how many years does it take money to double at {rate}% annual interest? "
        "Use the rule of 72 and then check it with the exact formula.",
    ]
    return _ask(rng, rng.choice(forms))


# ---------------------------------------------------------------- conversions and units

_UNITS = [  # (from, to, factor, sample range)
    ("kilometres", "miles", 0.621371, (3, 500)), ("miles", "kilometres", 1.609344, (1, 300)),
    ("kilograms", "pounds", 2.20462, (1, 150)), ("pounds", "kilograms", 0.453592, (1, 300)),
    ("litres", "US gallons", 0.264172, (2, 200)), ("inches", "centimetres", 2.54, (1, 100)),
    ("feet", "metres", 0.3048, (3, 5000)), ("ounces", "grams", 28.3495, (1, 64)),
    ("hours", "seconds", 3600, (1, 48)), ("days", "minutes", 1440, (1, 30)),
    ("square metres", "square feet", 10.7639, (5, 400)), ("cups", "millilitres", 236.588, (1, 12)),
    ("megabytes", "kilobytes", 1024, (1, 900)), ("knots", "km/h", 1.852, (5, 60)),
]


def conversions(rng: random.Random) -> str:
    src, dst, _, (lo, hi) = rng.choice(_UNITS)
    value = rng.randint(lo, hi)
    forms = [
        f"Convert {value} {src} to {dst}.", f"How many {dst} are in {value} {src}?",
        f"I have {value} {src}. What is that in {dst}?",
        f"Express {value} {src} in {dst}, rounded to two decimal places.",
    ]
    if rng.random() < 0.25:
        c = rng.randint(-30, 45)
        f_ = rng.randint(-10, 110)
        forms = [f"Convert {c} degrees Celsius to Fahrenheit.",
                 f"The thermometer reads {f_} °F. What is that in Celsius?",
                 f"Is {c} °C warmer or colder than {f_} °F? Show the conversion."]
    return _ask(rng, rng.choice(forms))


def time_calendar(rng: random.Random) -> str:
    h, m, add = rng.randint(1, 12), rng.choice([0, 5, 15, 20, 30, 40, 45, 55]), rng.randint(25, 600)
    days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
    forms = [
        f"It is {h}:{m:02d} {rng.choice(['a.m.', 'p.m.'])}. What time will it be in {add} minutes?",
        f"Today is {rng.choice(days)}. What day of the week will it be in {rng.randint(10, 1000)} days?",
        f"A film starts at {h}:{m:02d} and lasts {add // 60} hours and {add % 60} minutes. "
        "When does it end?",
        f"How many seconds are there in {rng.randint(2, 9)} weeks?",
        f"A meeting runs from {h}:{m:02d} to {(h + add // 60) % 12 or 12}:{(m + add) % 60:02d}. "
        "How long is it?",
        f"Bus A leaves every {rng.randint(6, 15)} minutes and bus B every {rng.randint(8, 25)} "
        "minutes. If they leave together at noon, when do they next leave together?",
    ]
    return _ask(rng, rng.choice(forms))


# ---------------------------------------------------------------- algebra and numbers

def linear_equation(rng: random.Random) -> str:
    a, b, x = rng.choice([2, 3, 4, 5, 6, 7, -2, -3]), rng.randint(-20, 20), rng.randint(-12, 12)
    c = a * x + b
    sign = "+" if b >= 0 else "-"
    forms = [
        f"Solve for x: {a}x {sign} {abs(b)} = {c}.",
        f"Find x if {a}x {sign} {abs(b)} equals {c}.",
        f"What value of y makes {a}y {sign} {abs(b)} = {c} true? Check your answer.",
        f"I think x = {x + rng.choice([-1, 1])} solves {a}x {sign} {abs(b)} = {c}. Am I right?",
    ]
    if rng.random() < 0.35:
        p, q = rng.randint(-6, 6), rng.randint(-6, 6)
        a1, b1, a2, b2 = rng.randint(1, 5), rng.randint(-4, 4) or 1, rng.randint(1, 5), rng.randint(-4, 4) or 2
        if a1 * b2 != a2 * b1:
            forms = [f"Solve the system: {a1}x + {b1}y = {a1 * p + b1 * q} and "
                     f"{a2}x + {b2}y = {a2 * p + b2 * q}.",
                     f"Find x and y such that {a1}x + {b1}y = {a1 * p + b1 * q} and "
                     f"{a2}x + {b2}y = {a2 * p + b2 * q}."]
    return _ask(rng, rng.choice(forms).replace("+ -", "- "))


def quadratic(rng: random.Random) -> str:
    r1, r2 = rng.randint(-9, 9), rng.randint(-9, 9)
    k = rng.choice([1, 1, 1, 2, 3])
    b, c = -k * (r1 + r2), k * r1 * r2
    poly = f"{k if k > 1 else ''}x^2 + {b}x + {c}".replace("+ -", "- ")
    forms = [f"Find the roots of {poly} = 0.", f"Factor {poly}.",
             f"Solve the quadratic equation {poly} = 0 using the quadratic formula.",
             f"For what values of x is {poly} negative?",
             f"What is the vertex of the parabola y = {poly}?"]
    return _ask(rng, rng.choice(forms))


def fractions_problem(rng: random.Random) -> str:
    f1 = Fraction(rng.randint(1, 9), rng.randint(2, 12))
    f2 = Fraction(rng.randint(1, 9), rng.randint(2, 12))
    op = rng.choice(["+", "-", "×", "÷"])
    forms = [f"Compute {f1} {op} {f2} and simplify.", f"What is {f1} {op} {f2}? Give a fraction.",
             f"Simplify the fraction {f1.numerator * 6}/{f1.denominator * 6}.",
             f"Which is larger, {f1} or {f2}? By how much?",
             f"Write {f1} as a decimal and as a percentage.",
             f"A recipe needs {f1} cup of sugar. How much is needed for {rng.randint(2, 5)} "
             "batches?"]
    return _ask(rng, rng.choice(forms))


def ratios(rng: random.Random) -> str:
    a, b = rng.randint(1, 7), rng.randint(1, 9)
    total = (a + b) * rng.randint(2, 20)
    name1, name2 = _pick_names(rng, 2)
    forms = [
        f"{name1} and {name2} share {_money(total)} in the ratio {a}:{b}. How much does each get?",
        f"A paint mix uses blue and white in the ratio {a}:{b}. How much white is needed with "
        f"{a * 3} litres of blue?",
        f"A recipe for {b + 2} people uses {a * 100} g of flour. How much flour for "
        f"{b + 7} people?",
        f"On a map, 1 cm represents {b * 5} km. Two cities are {a + 2.5} cm apart. How far "
        "apart are they really?",
        f"The ratio of cats to dogs at a shelter is {a}:{b}. There are {total} animals. How "
        "many are dogs?",
    ]
    return _ask(rng, rng.choice(forms))


def number_theory(rng: random.Random) -> str:
    a, b = rng.randint(12, 300), rng.randint(12, 300)
    n = rng.randint(50, 2000)
    forms = [f"Find the greatest common divisor of {a} and {b}.",
             f"What is the least common multiple of {a % 40 + 2} and {b % 30 + 3}?",
             f"Is {n} a prime number? Explain how you checked.",
             f"Find the prime factorisation of {n}.",
             f"What is the remainder when {n} is divided by {rng.randint(3, 13)}?",
             f"What is the sum of the digits of {n * rng.randint(3, 97)}?",
             f"How many positive divisors does {n} have?",
             f"Is {n} divisible by 3, by 4 and by 9? Use divisibility rules.",
             f"List all prime numbers between {n % 100} and {n % 100 + 30}."]
    return _ask(rng, rng.choice(forms))


def sequences(rng: random.Random) -> str:
    start, step = rng.randint(-10, 30), rng.randint(2, 12)
    ratio = rng.choice([2, 3, -2, 0.5])
    kind = rng.randrange(5)
    if kind == 0:
        terms = [start + i * step for i in range(5)]
        q = f"What are the next two terms of {', '.join(map(str, terms))}, ...?"
    elif kind == 1:
        q = (f"An arithmetic sequence starts at {start} with common difference {step}. What "
             f"is the {rng.randint(10, 60)}th term?")
    elif kind == 2:
        terms = [round(start * ratio ** i, 3) if start else round((i + 1) * ratio ** i, 3)
                 for i in range(4)]
        q = f"Find the rule and the next term: {', '.join(map(str, terms))}, ..."
    elif kind == 3:
        q = f"What is the sum of the first {rng.randint(10, 200)} positive {rng.choice(['integers', 'odd numbers', 'even numbers'])}?"
    else:
        a, b = rng.randint(1, 5), rng.randint(1, 5)
        terms = [a, b]
        for _ in range(4):
            terms.append(terms[-1] + terms[-2])
        q = f"Each term is the sum of the two before it: {', '.join(map(str, terms))}, ... What comes next?"
    return _ask(rng, q)


def exponents(rng: random.Random) -> str:
    base, e1, e2 = rng.randint(2, 9), rng.randint(2, 6), rng.randint(2, 5)
    big = rng.randint(101, 9999) * 10 ** rng.randint(3, 9)
    forms = [f"Simplify {base}^{e1} × {base}^{e2}.", f"What is {base}^{e1}?",
             f"Write {big:,} in scientific notation.",
             f"Evaluate log base {base} of {base ** e1}.",
             f"Solve for x: {base}^x = {base ** e1}.",
             f"What is the square root of {rng.randint(4, 40) ** 2}?",
             f"Estimate the square root of {rng.randint(10, 999)} to one decimal place."]
    return _ask(rng, rng.choice(forms))


def functions(rng: random.Random) -> str:
    a, b, c, x = rng.randint(-5, 6), rng.randint(-9, 9), rng.randint(1, 4), rng.randint(-4, 5)
    f = f"f(x) = {a}x + {b}".replace("+ -", "- ")
    g = f"g(x) = x^2 - {c}"
    forms = [f"If {f}, what is f({x})?", f"Given {f} and {g}, find f(g({x})).",
             f"Given {f} and {g}, find g(f(x)) and simplify.",
             f"Find the inverse of {f}." if a else f"Is {f} a constant function?",
             f"What is the slope of the line through ({x}, {b}) and ({x + c}, {b + a * c})?",
             f"Find the equation of the line through ({x}, {b}) with slope {a}.",
             f"Where does the line y = {a}x + {b} cross the x-axis?".replace("+ -", "- ")]
    return _ask(rng, rng.choice(forms))


def calculus(rng: random.Random) -> str:
    a, b, c, n = rng.randint(1, 9), rng.randint(-9, 9), rng.randint(-9, 9), rng.randint(2, 5)
    poly = f"{a}x^{n} + {b}x + {c}".replace("+ -", "- ")
    forms = [f"Differentiate {poly}.", f"Find the integral of {poly} with respect to x.",
             f"What is the slope of y = {poly} at x = {rng.randint(-3, 3)}?",
             f"Find the definite integral of {poly} from 0 to {rng.randint(1, 4)}.",
             f"Where does y = x^2 + {b}x + {c} have its minimum?".replace("+ -", "- "),
             f"What is the derivative of sin({a}x) + e^({n}x)?"]
    return _ask(rng, rng.choice(forms))


def inequalities(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 9), rng.randint(-15, 15), rng.randint(-20, 30)
    rel = rng.choice(["<", ">", "≤", "≥"])
    forms = [f"Solve the inequality {a}x + {b} {rel} {c}.".replace("+ -", "- "),
             f"Find all integers x with {b} < {a}x < {b + 5 * a}.",
             f"Solve |x - {abs(b)}| < {a} and write the answer as an interval.",
             f"For which x is -{a}x + {b} {rel} {c}? Be careful with the sign.".replace("+ -", "- ")]
    return _ask(rng, rng.choice(forms))


# ---------------------------------------------------------------- geometry, probability

def geometry(rng: random.Random) -> str:
    w, h, r = rng.randint(2, 40), rng.randint(2, 30), rng.randint(1, 20)
    a, b = rng.choice([(3, 4), (5, 12), (8, 15), (6, 8), (7, 24), (9, 12)])
    k = rng.randint(1, 4)
    forms = [f"A rectangle is {w} cm by {h} cm. What are its area and perimeter?",
             f"Find the area and circumference of a circle with radius {r} m.",
             f"A right triangle has legs {a * k} and {b * k}. How long is the hypotenuse?",
             f"What is the volume of a box that is {w} × {h} × {r} inches?",
             f"A cylinder has radius {r} cm and height {h} cm. What is its volume?",
             f"A triangle has base {w} and height {h}. What is its area?",
             f"The angles of a triangle are {w + 20}°, {h + 30}° and x. Find x.",
             f"A square garden has area {w * w} m². How much fencing goes around it?",
             f"What is the sum of the interior angles of a polygon with {rng.randint(5, 12)} sides?",
             f"A circular track has a diameter of {2 * r * 10} m. How far is {k + 1} laps?"]
    return _ask(rng, rng.choice(forms))


def probability(rng: random.Random) -> str:
    red, blue, green = rng.randint(1, 9), rng.randint(1, 9), rng.randint(0, 6)
    n_dice, target = rng.choice([1, 2, 2]), rng.randint(2, 12)
    forms = [f"A bag holds {red} red, {blue} blue and {green} green marbles. What is the "
             "probability of drawing a blue one?",
             f"A bag holds {red} red and {blue} blue marbles. Two are drawn without "
             "replacement. What is the probability both are red?",
             f"If you roll {n_dice} fair six-sided {'die' if n_dice == 1 else 'dice'}, what is "
             f"the probability the total is {min(target, 6 * n_dice)}?",
             f"A fair coin is tossed {rng.randint(3, 8)} times. What is the probability of "
             f"exactly {rng.randint(1, 3)} heads?",
             f"A spinner has {red + blue} equal sections, {red} of them yellow. If it is spun "
             "twice, what is the chance of at least one yellow?",
             f"{rng.randint(10, 60)}% of emails are spam. A filter catches {rng.randint(80, 99)}% "
             f"of spam and wrongly flags {rng.randint(1, 9)}% of good mail. If an email is "
             "flagged, how likely is it to be spam?"]
    return _ask(rng, rng.choice(forms))


def combinatorics(rng: random.Random) -> str:
    n, k = rng.randint(5, 12), rng.randint(2, 4)
    word = rng.choice(["LEVEL", "BANANA", "PLANET", "ORANGE", "COFFEE", "GARDEN", "RIVER", "TEAPOT"])
    forms = [f"In how many ways can a committee of {k} be chosen from {n} people?",
             f"How many ways can {k} different prizes be given to {n} contestants if nobody "
             "gets two?",
             f"How many distinct arrangements of the letters in {word} are there?",
             f"A menu has {k + 2} starters, {n} mains and {k} desserts. How many three-course "
             "meals are possible?",
             f"How many handshakes happen if {n} people each shake hands with everyone else once?",
             f"How many {k + 2}-digit codes can be made from the digits 0-9 if digits may not repeat?"]
    return _ask(rng, rng.choice(forms))


def statistics(rng: random.Random) -> str:
    data = [rng.randint(1, 60) for _ in range(rng.randint(5, 9))]
    listed = ", ".join(map(str, data))
    a = rng.choice(NAMES)
    forms = [f"Find the mean, median and mode of: {listed}.",
             f"What is the range of the data set {listed}?",
             f"{a}'s test scores are {listed}. What score on the next test would raise the "
             f"average to {round(sum(data) / len(data)) + 3}?",
             f"Compute the standard deviation of {listed}.",
             f"The average of {len(data)} numbers is {round(sum(data) / len(data), 1)}. One "
             f"number, {data[0]}, is removed. What is the new average?"]
    return _ask(rng, rng.choice(forms))


def ages(rng: random.Random) -> str:
    a, b = _pick_names(rng, 2)
    age, diff, years = rng.randint(5, 40), rng.randint(2, 30), rng.randint(2, 15)
    k = rng.randint(2, 4)
    forms = [f"{a} is {diff} years older than {b}. In {years} years their ages will add up "
             f"to {2 * age + diff + 2 * years}. How old is {b} now?",
             f"{a} is {k} times as old as {b}. In {years} years {a} will be "
             f"{k * age + years} years old. How old is {b} now?",
             f"{years} years ago, {a} was {age} years old. How old will {a} be in {diff} years?",
             f"The sum of {a}'s and {b}'s ages is {2 * age + diff}, and {a} is {diff} years "
             "older. Find both ages."]
    return _ask(rng, rng.choice(forms))


def mixtures(rng: random.Random) -> str:
    v1, c1, v2, c2 = rng.randint(1, 10), rng.choice([5, 10, 20, 30]), rng.randint(1, 10), rng.choice([40, 50, 60, 80])
    forms = [f"Mixing {v1} litres of a {c1}% salt solution with {v2} litres of a {c2}% "
             "solution gives what concentration?",
             f"How much water must be added to {v1} litres of {c2}% juice to make it {c1}% juice?",
             f"Coffee beans costing {_money(c1 / 2)} per kg are mixed with beans costing "
             f"{_money(c2 / 4)} per kg to make {v1 + v2} kg at {_money((c1 / 2 + c2 / 4) / 2)} "
             "per kg. How much of each is used?"]
    return _ask(rng, rng.choice(forms))


def bases(rng: random.Random) -> str:
    n = rng.randint(5, 4095)
    forms = [f"Convert {n} to binary.", f"What is the decimal value of binary {n:b}?",
             f"Write {n} in hexadecimal.", f"Convert hex {n:X} to decimal.",
             f"Add the binary numbers {n % 64:b} and {(n // 7) % 64:b}.",
             f"How many bits are needed to represent {n} in binary?"]
    return _ask(rng, rng.choice(forms))


def linear_algebra(rng: random.Random) -> str:
    m = [[rng.randint(-5, 9) for _ in range(2)] for _ in range(2)]
    u = [rng.randint(-4, 6) for _ in range(3)]
    v = [rng.randint(-4, 6) for _ in range(3)]
    forms = [f"Find the determinant of the matrix [[{m[0][0]}, {m[0][1]}], [{m[1][0]}, {m[1][1]}]].",
             f"Compute the dot product of {tuple(u)} and {tuple(v)}.",
             f"What is the length of the vector {tuple(u)}?",
             f"Multiply the matrix [[{m[0][0]}, {m[0][1]}], [{m[1][0]}, {m[1][1]}]] by the vector "
             f"({u[0]}, {u[1]}).",
             f"Find the cross product of {tuple(u)} and {tuple(v)}.",
             f"Is the matrix [[{m[0][0]}, {m[0][1]}], [{m[1][0]}, {m[1][1]}]] invertible? If so, find its inverse."]
    return _ask(rng, rng.choice(forms))


# ---------------------------------------------------------------- logic and puzzles

def ordering_puzzle(rng: random.Random) -> str:
    people = _pick_names(rng, rng.randint(3, 5))
    trait = rng.choice([("taller", "tallest", "shortest"), ("older", "oldest", "youngest"),
                        ("faster", "fastest", "slowest"), ("richer", "richest", "poorest")])
    order = people[:]
    rng.shuffle(order)
    facts = [f"{order[i]} is {trait[0]} than {order[i + 1]}" for i in range(len(order) - 1)]
    rng.shuffle(facts)
    ask = rng.choice([f"Who is the {trait[1]}?", f"Who is the {trait[2]}?",
                      f"List them from {trait[1]} to {trait[2]}."])
    return _ask(rng, f"{'. '.join(facts)}. {ask}")


def knights_knaves(rng: random.Random) -> str:
    a, b = _pick_names(rng, 2)
    kinds = rng.choice([("knights", "knaves", "always tell the truth", "always lie"),
                        ("truth-tellers", "liars", "never lie", "never tell the truth")])
    claims = [f'{a} says: "{b} and I are both {kinds[1]}."',
              f'{a} says: "At least one of us is a {kinds[1][:-1]}."',
              f'{a} says: "{b} is a {kinds[0][:-1]}." {b} says: "{a} and I are different kinds."',
              f'{a} says: "We are the same kind." {b} says: "{a} is a {kinds[1][:-1]}."']
    return _ask(rng, f"On an island, {kinds[0]} {kinds[2]} and {kinds[1]} {kinds[3]}. "
                     f"{rng.choice(claims)} What are {a} and {b}?")


def syllogism(rng: random.Random) -> str:
    groups = ["cats", "musicians", "engineers", "birds", "teachers", "gardeners", "robots",
              "poets", "chess players", "swimmers", "bakers", "pilots", "mammals", "students"]
    x, y, z = rng.sample(groups, 3)
    forms = [f"All {x} are {y}. Some {y} are {z}. Does it follow that some {x} are {z}?",
             f"No {x} are {y}. All {z} are {y}. Can any {z} be {x}? Explain.",
             f"If every {x[:-1]} is a {y[:-1]} and no {y[:-1]} is a {z[:-1]}, is any {x[:-1]} a {z[:-1]}?",
             f"Some {x} are {y}, and all {y} are {z}. Which of these must be true: (a) some {x} "
             f"are {z}; (b) all {z} are {x}; (c) no {x} are {z}?"]
    return _ask(rng, rng.choice(forms))


def lateral(rng: random.Random) -> str:
    a = rng.choice(NAMES)
    n = rng.randint(3, 12)
    forms = [f"{a} has {n} socks of each of three colours in a drawer and picks in the dark. "
             "How many must be taken to be sure of a matching pair?",
             f"A snail climbs {n} feet up a wall each day and slides back {n - 2} feet each "
             f"night. How many days to reach the top of a {n * 4}-foot wall?",
             f"You have {n} coins and one is lighter. With a balance scale, what is the fewest "
             "weighings needed to find it?",
             f"If {n} machines make {n} widgets in {n} minutes, how long do {n * 10} machines "
             f"take to make {n * 10} widgets?",
             f"A clock shows {rng.randint(1, 12)}:{rng.choice(['15', '30', '45', '20'])}. What is "
             "the angle between the hour and minute hands?",
             f"Three boxes are labelled 'apples', 'oranges' and 'mixed', and every label is "
             "wrong. You may take one fruit from one box. How do you fix the labels?"]
    return _ask(rng, rng.choice(forms))


def estimation(rng: random.Random) -> str:
    city = rng.choice(["a city of one million people", "a small town", "London", "Tokyo",
                       "a large university", "a busy airport", "New York"])
    thing = rng.choice(["piano tuners", "pizzas eaten each day", "litres of water used each day",
                        "bicycles", "dentists", "coffee cups sold each morning",
                        "trees", "school buses"])
    return _ask(rng, rng.choice([
        f"Roughly how many {thing} are there in {city}? Make a Fermi estimate and state your "
        "assumptions.",
        f"Estimate the number of {thing} in {city}. Break the problem into steps.",
    ]))


def budgeting(rng: random.Random) -> str:
    a = rng.choice(NAMES)
    income = rng.choice([1800, 2400, 3200, 4100, 5500])
    rent, save = rng.choice([25, 30, 35, 40]), rng.choice([5, 10, 15, 20])
    goal = rng.choice([900, 1500, 3000, 6000])
    forms = [f"{a} earns {_money(income)} a month, spends {rent}% on rent and saves {save}%. "
             f"How long until {a} has saved {_money(goal)}?",
             f"{a} earns {_money(rng.randint(12, 40))} per hour and works {rng.randint(15, 45)} "
             "hours a week. What are the weekly and yearly earnings?",
             f"A phone costs {_money(goal / 3)} up front, or {_money(goal / 30 + 5)} a month for "
             "a year. How much more does the monthly plan cost?"]
    return _ask(rng, rng.choice(forms))


MATH_FAMILIES = [
    (shopping, 3), (collection, 3), (rates, 2), (work_rate, 1), (percentages, 3),
    (interest, 1), (conversions, 2), (time_calendar, 2), (linear_equation, 2), (quadratic, 1),
    (fractions_problem, 2), (ratios, 2), (number_theory, 2), (sequences, 2), (exponents, 1),
    (functions, 1), (calculus, 1), (inequalities, 1), (geometry, 2), (probability, 2),
    (combinatorics, 1), (statistics, 1), (ages, 1), (mixtures, 1), (bases, 1),
    (linear_algebra, 1), (ordering_puzzle, 1), (knights_knaves, 1), (syllogism, 1),
    (lateral, 1), (estimation, 1), (budgeting, 1),
]
"""``(family, weight)``: each family's source name is ``gen.math.<family.__name__>``."""
