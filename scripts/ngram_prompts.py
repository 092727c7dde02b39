"""Prompts for prompt-lookup (n-gram) speculation benchmarks: input-grounded tasks over one passage, and open-ended
ones. The passage (about 300 tokens with the SmolLM2 tokenizer) was written for this benchmark."""
from __future__ import annotations

PASSAGE = """The lighthouse keeper's log for the winter of the storm records every change in the weather, every ship
that passed the point and every repair made to the lamp. On the first of December the wind turned to the north-east
and the sea rose so high that spray reached the gallery windows. The keeper, Anna Ruud, wrote that the lamp was lit at
four in the afternoon and trimmed twice before midnight. On the third, a fishing boat named the Marta lost its mast
two miles off the point; the crew rowed into the harbour at dawn and all five men were safe. On the seventh the
supply boat could not land, so the keeper rationed the paraffin and lit only the main lens, leaving the harbour light
dark for two nights. On the tenth the weather cleared. The supply boat brought paraffin, flour, coal and a letter from
the harbour board asking for a full report on the damage to the landing stage. Anna measured the damage herself: three
planks broken, one iron ring torn from the rock, and the lower steps covered in weed. She repaired the planks with
timber from the store, and asked the board for a smith to replace the ring before the spring tides. The log ends the
month with a short note: the lamp never failed, no ship was lost, and the keeper slept on the eleventh for the first
time in four days."""

CODE = '''def total_price(items, tax_rate):
    total = 0
    for item in items:
        price = item["price"]
        quantity = item["quantity"]
        if quantity < 0:
            raise ValueError("quantity must not be negative")
        total = total + price * quantity
    tax = total * tax_rate
    return total + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best


def apply_discount(items, percent):
    if percent < 0 or percent > 100:
        raise ValueError("percent must be between 0 and 100")
    discounted = []
    for item in items:
        price = item["price"] * (100 - percent) / 100
        discounted.append({"name": item["name"], "price": price, "quantity": item["quantity"]})
    return discounted


def receipt(items, tax_rate):
    lines = []
    for item in items:
        lines.append(f"{item['name']}: {item['quantity']} x {item['price']:.2f}")
    total = total_price(items, tax_rate)
    lines.append(f"total: {total:.2f}")
    return "\n".join(lines)
'''

GROUNDED = {
    "repeat": f"Copy the following text exactly, word for word:\n\n{PASSAGE}",
    "rewrite": f"Rewrite the following text in the present tense, keeping every detail:\n\n{PASSAGE}",
    "summarize": f"Summarize the following log, quoting the keeper's own words where you can:\n\n{PASSAGE}",
    "code-edit": f"Rename the variable `total` to `subtotal` in this Python code and print the whole code:\n\n{CODE}",
}

OPEN_ENDED = {
    "story": "Write a short story about a robot who learns to paint.",
    "explain": "Explain why the sky is blue to a ten-year-old.",
    "advice": "Give me five tips for learning a new language.",
}


# The second set: two other passages and another piece of code, a check that a change to the draft rule or the
# policy is not fitted to the prompts above alone (`bench_ngram.py --set held-out`).
MEETING = """The village council met on Tuesday evening in the school hall to discuss the new bridge over the river. The
engineer, Tomas Berg, explained that the old wooden bridge had rotted at both ends and could carry no more than two
tonnes, so the milk lorry had to take the long road through the forest every morning. He proposed a steel bridge on
concrete piers, eight metres wide, with a footpath on the east side. The cost would be forty thousand crowns, half of
it paid by the county. Mrs Lind, who runs the bakery, asked whether the road would be closed during the work; the
engineer said it would be closed for six weeks in the summer, and that a temporary footbridge would be built for
pedestrians. The farmers asked for the work to start after the harvest. After a long discussion the council voted
seven to two to build the bridge, to start in September, and to ask the county for the money before the end of the
month. The meeting closed at half past nine."""

RECIPE = """To bake the rye bread, mix five hundred grams of rye flour with four hundred millilitres of warm water and one
hundred grams of sourdough starter. Cover the bowl and leave it overnight in a warm kitchen. In the morning add ten
grams of salt, a spoon of honey and two hundred grams of wheat flour, and knead the dough for ten minutes until it
is smooth. Shape it into a loaf, put it in a greased tin and let it rise for two hours, until it has grown by half.
Heat the oven to two hundred and thirty degrees, put a tray of water on the bottom shelf, and bake the loaf for
fifteen minutes; then lower the heat to two hundred degrees and bake it for forty minutes more. The bread is done
when it sounds hollow when you knock on the bottom. Let it cool on a rack for at least three hours before cutting."""

CLASS_CODE = '''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count):
        if count <= 0:
            raise ValueError("count must be positive")
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count):
        if name not in self.items:
            raise KeyError(name)
        if count > self.items[name]:
            raise ValueError("not enough items")
        self.items[name] = self.items[name] - count
        if self.items[name] == 0:
            del self.items[name]

    def total(self):
        return sum(self.items.values())
'''

HELD_OUT_GROUNDED = {
    "summ-notes": f"Summarize the following meeting notes in a few sentences:\n\n{MEETING}",
    "summ-quote": f"Summarize the following text, quoting its own words where you can:\n\n{MEETING}",
    "rewrite": f"Rewrite the following text in the present tense, keeping every detail:\n\n{MEETING}",
    "copy": f"Copy the following text exactly:\n\n{MEETING}",
    "list": f"List every decision and every number mentioned in this text:\n\n{MEETING}",
    "steps": f"Summarize this recipe as a list of steps:\n\n{RECIPE}",
    "for-child": f"Rewrite this recipe for a child, keeping every quantity:\n\n{RECIPE}",
    "answer": f"Read the recipe and answer: how long does the bread bake, and at what temperatures?\n\n{RECIPE}",
    "rename": f"Rename the method `remove` to `take` in this Python code and print the whole code:\n\n{CLASS_CODE}",
    "docstrings": f"Add a docstring to every method of this Python class and print the whole code:\n\n{CLASS_CODE}",
}

HELD_OUT_OPEN = {
    "keeper-day": "Describe a day in the life of a lighthouse keeper.",
    "exercise": "What are the benefits of regular exercise?",
}
