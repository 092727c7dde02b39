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
