"""Templated chat / writing / advice prompts (kind ``chat``), composed from word lists.

These are the corpus's only templated prompts besides the story openings and synthetic
documents of :mod:`domino_jax.train.corpus_text`; the builder keeps them a minority (default
share 0.18 of the corpus). A prompt is a request type (explain, advice, writing, planning,
comparison, brainstorm, rewrite, how-to, opinion, role-play) filled with a topic, an
audience, a tone and/or a format constraint, so few prompts share more than a phrase.
"""

from __future__ import annotations

import random
from typing import Iterator

TOPICS = [
    # science and nature
    "photosynthesis", "black holes", "plate tectonics", "the water cycle", "vaccines",
    "the immune system", "DNA replication", "climate change", "ocean currents", "volcanoes",
    "honey bees", "coral reefs", "the placebo effect", "antibiotic resistance", "gravity waves",
    "the periodic table", "evolution by natural selection", "sleep cycles", "the Northern Lights",
    "rainbows", "earthquakes", "bird migration", "the human microbiome", "nuclear fusion",
    "entropy", "the speed of light", "dark matter", "tides", "fermentation", "glaciers",
    # technology
    "machine learning", "public-key cryptography", "the internet's routing", "GPS",
    "electric cars", "solar panels", "blockchain", "quantum computing", "3D printing",
    "password managers", "cloud storage", "open-source software", "smartphone batteries",
    "search engines", "recommendation algorithms", "wind turbines", "heat pumps", "5G networks",
    "noise-cancelling headphones", "compilers", "databases", "virtual reality",
    # history and society
    "the printing press", "the Silk Road", "the Roman Republic", "the Industrial Revolution",
    "the invention of writing", "the history of coffee", "the Olympic Games", "democracy",
    "the Renaissance", "the history of maps", "the space race", "the abolition of slavery",
    "the history of vaccines", "ancient Egyptian medicine", "the Hanseatic League",
    "the history of the bicycle", "the origins of chess", "public libraries", "trade unions",
    # economics and life
    "compound interest", "inflation", "index funds", "supply and demand", "minimum wage",
    "credit scores", "budgeting", "remote work", "the gig economy", "universal basic income",
    "time management", "procrastination", "public speaking", "learning a new language",
    "minimalism", "meal planning", "houseplants", "urban gardening", "composting",
    "running a marathon", "strength training", "meditation", "journaling", "bread baking",
    "fermenting vegetables", "birdwatching", "photography", "learning the guitar", "knitting",
    # arts and culture
    "jazz improvisation", "impressionist painting", "haiku", "film noir", "the sonnet",
    "street art", "opera", "folk tales", "science fiction", "architecture of cathedrals",
    "typography", "stand-up comedy", "board games", "video game design", "poetry slams",
]
AUDIENCES = ["a ten-year-old", "a high-school student", "my grandmother", "a busy executive",
             "a complete beginner", "a university student", "someone who hates maths",
             "a new employee", "a curious teenager", "an expert in a different field"]
TONES = ["friendly", "formal", "humorous", "enthusiastic", "calm", "persuasive", "poetic",
         "matter-of-fact", "warm", "playful"]
FORMATS = ["in three bullet points", "in under 100 words", "as a numbered list",
           "in one paragraph", "with an analogy", "with a concrete example", "as a short dialogue",
           "in five sentences", "as a table", "step by step"]
SITUATIONS = [
    "I just started a new job and feel overwhelmed", "my roommate never cleans the kitchen",
    "I want to save money but keep eating out", "I have an exam in two weeks and have not started",
    "my team keeps missing deadlines", "I moved to a new city and don't know anyone",
    "my manager gives vague feedback", "I can't decide between two job offers",
    "I get nervous before presentations", "my friend always cancels plans at the last minute",
    "I want to get back into exercise after an injury", "my kids spend too much time on screens",
    "I keep waking up at 3 a.m.", "my neighbour's dog barks all night",
    "I want to ask for a raise", "I am burning out from working late",
    "I was asked to lead a project for the first time", "I want to learn to code at 45",
    "I have too many subscriptions", "my sister and I argue about caring for our parents",
    "I want to start a small business selling crafts", "I forget birthdays all the time",
]
WRITING_FORMS = ["a poem", "a haiku", "a limerick", "a short story", "a product description",
                 "a wedding toast", "a cover letter", "a thank-you note", "a blog post intro",
                 "a tweet", "a song chorus", "a speech opening", "a fable", "a diary entry",
                 "a motivational message", "a news headline and lede", "a restaurant review",
                 "a bedtime story", "a job advertisement", "a LinkedIn post", "a eulogy",
                 "a riddle", "a travel postcard", "a letter to my future self"]
PLANS = ["a three-day trip to {place}", "a week of vegetarian dinners", "a study schedule for {t}",
         "a birthday party for a seven-year-old", "a 30-day beginner workout routine",
         "a reading list about {t}", "a weekend in {place} on a tight budget",
         "a small garden on a balcony", "a one-hour workshop about {t}", "a morning routine",
         "a team offsite for twelve people", "a podcast episode about {t}", "a move to {place}"]
PLACES = ["Lisbon", "Kyoto", "Mexico City", "Edinburgh", "Nairobi", "Vancouver", "Istanbul",
          "Hanoi", "Buenos Aires", "Reykjavik", "Marrakesh", "Seoul", "Prague", "Cape Town",
          "a national park", "the countryside", "a small coastal town", "the mountains"]
HOWTOS = ["remove a coffee stain from a carpet", "negotiate the price of a used car",
          "write a good email subject line", "change a bicycle tyre", "keep basil alive indoors",
          "make a sourdough starter", "fall asleep faster", "organise a messy closet",
          "prepare for a job interview", "take better photos with a phone", "learn names quickly",
          "build an emergency fund", "start journaling", "give constructive feedback",
          "clean a cast-iron pan", "pack light for a two-week trip", "memorise a speech",
          "choose a good watermelon", "reduce food waste", "write a complaint letter"]
SENTENCES = ["we was going to the store yesterday but it were closed",
             "Our product is very good and it is the best and everyone should buy it",
             "The meeting that was scheduled has been moved to a later time that is to be decided",
             "i think maybe we could possibly consider perhaps changing the plan",
             "Due to the fact that it was raining, the event was cancelled by the organisers",
             "Their going to announce the results tomorrow, its going to be exiting",
             "The report, which was long, and which nobody read, was finally approved",
             "Please kindly do the needful and revert back at the earliest"]
PERSONAS = ["a medieval blacksmith", "a tour guide in ancient Rome", "a pirate captain",
            "a friendly librarian", "a detective in 1920s Chicago", "a park ranger",
            "a barista who loves coffee trivia", "a chess coach", "a museum curator",
            "a retired astronaut", "a gardening expert", "a personal trainer"]
QUESTIONS = ["Is it better to rent or buy a home?", "Should homework be banned?",
             "Is social media good for teenagers?", "Are electric scooters good for cities?",
             "Should I learn Python or JavaScript first?", "Is a four-day work week a good idea?",
             "Are zoos ethical?", "Is it worth learning Latin?", "Should tipping be abolished?",
             "Is it okay to read the last page of a book first?", "Do we need daylight saving time?",
             "Is nuclear power a good answer to climate change?", "Should cities ban cars downtown?"]


def chat_prompt(rng: random.Random) -> tuple[str, str]:
    """One composed chat/writing/advice prompt: ``(source, prompt)``."""
    t, u = rng.sample(TOPICS, 2)
    form = rng.randrange(11)
    if form == 0:
        return "template.chat.explain", rng.choice([
            f"Explain {t} to {rng.choice(AUDIENCES)}.", f"What is {t}? Answer {rng.choice(FORMATS)}.",
            f"Can you explain {t} {rng.choice(FORMATS)}?", f"How does {t} work?",
            f"Why does {t} matter? Explain it to {rng.choice(AUDIENCES)}.",
            f"What are three common misconceptions about {t}?"])
    if form == 1:
        s = rng.choice(SITUATIONS)
        return "template.chat.advice", rng.choice([
            f"{s}. What should I do?", f"{s}. Any advice?", f"{s}. How can I handle this?",
            f"{s}. Can you give me a plan {rng.choice(FORMATS)}?",
            f"My friend says {s.lower().replace('i ', 'they ', 1)}. How can I help them?"])
    if form == 2:
        w = rng.choice(WRITING_FORMS)
        return "template.chat.writing", rng.choice([
            f"Write {w} about {t}.", f"Write {w} about {t} in a {rng.choice(TONES)} tone.",
            f"Can you write {w} that mentions {t} and {u}?",
            f"Write {w} about {t} for {rng.choice(AUDIENCES)}."])
    if form == 3:
        plan = rng.choice(PLANS).format(place=rng.choice(PLACES), t=t)
        return "template.chat.plan", rng.choice([
            f"Help me plan {plan}.", f"Make {plan} {rng.choice(FORMATS)}.",
            f"Can you put together {plan}? I have limited time."])
    if form == 4:
        return "template.chat.compare", rng.choice([
            f"Compare {t} and {u}.", f"What do {t} and {u} have in common?",
            f"Which is more interesting to learn about, {t} or {u}? Argue both sides.",
            f"Write a short comparison of {t} and {u} {rng.choice(FORMATS)}."])
    if form == 5:
        n = rng.randint(3, 12)
        return "template.chat.brainstorm", rng.choice([
            f"Give me {n} ideas for a school project about {t}.",
            f"List {n} questions a student might ask about {t}.",
            f"Suggest {n} names for a podcast about {t}.", f"Brainstorm {n} blog post titles about {t}.",
            f"What are {n} fun facts about {t}?", f"Give me {n} conversation starters about {t}."])
    if form == 6:
        s = rng.choice(SENTENCES)
        return "template.chat.rewrite", rng.choice([
            f"Rewrite this sentence so it sounds {rng.choice(TONES)}: \"{s}\"",
            f"Fix the grammar: \"{s}\"", f"Make this more concise: \"{s}\"",
            f"Rewrite this for {rng.choice(AUDIENCES)}: \"{s}\""])
    if form == 7:
        h = rng.choice(HOWTOS)
        return "template.chat.howto", rng.choice([
            f"How do I {h}?", f"What's the best way to {h}?", f"Explain how to {h} {rng.choice(FORMATS)}.",
            f"I've never tried to {h}. Where do I start?"])
    if form == 8:
        q = rng.choice(QUESTIONS)
        return "template.chat.opinion", rng.choice([
            q, f"{q} Give arguments for and against.", f"{q} Answer in a {rng.choice(TONES)} way.",
            f"{q} What would {rng.choice(PERSONAS)} say?"])
    if form == 9:
        p = rng.choice(PERSONAS)
        return "template.chat.roleplay", rng.choice([
            f"Pretend you are {p}. Tell me about your day.",
            f"You are {p}. Explain {t} in character.",
            f"Act as {p} and give me advice about {t}."])
    return "template.chat.recommend", rng.choice([
        f"Recommend some books about {t} for {rng.choice(AUDIENCES)}.",
        f"What should I read or watch to understand {t}?",
        f"I'm interested in {t} and {u}. What hobbies might I enjoy?",
        f"Suggest a weekend activity related to {t}."])


def chat_prompts(rng: random.Random) -> Iterator[tuple[str, str]]:
    while True:
        yield chat_prompt(rng)
