"""The example rows of docs/own-data.md, one file per row shape: support tickets triaged into a category.

    .venv/bin/python trainer/samples/own/make_examples.py     # rewrites the four files beside this script

Made up, deterministic (no randomness): 8 phrasings x 4 categories x 2 products = 64 tickets.
- tickets.csv: the flat table (`ticket`, `product`, `category`) for `data.format: columns`;
- tickets-messages.jsonl: the same rows as trl conversational rows (system, user, assistant);
- tickets-prompt-completion.jsonl: the same rows as trl prompt-completion rows (plain strings);
- tickets-sharegpt.jsonl: the same rows as ShareGPT rows (`conversations` of {from: system|human|gpt, value}).
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
SYSTEM = "You triage support tickets. Answer with one word: billing, technical, account or shipping."
PROMPT = "Product: {product}\nTicket: {ticket}"
PRODUCTS = ("the Aurora kettle", "the Nimbus router")
TICKETS = {
    "billing": [
        "I was charged twice for {p} this month.",
        "The invoice for {p} shows the wrong amount.",
        "Can I get a refund for {p}? I returned it last week.",
        "My card was declined when paying for {p}, but the money left my account.",
        "Why does my receipt for {p} include a fee I did not agree to?",
        "I want to switch the payment method for my {p} subscription.",
        "The discount code was not applied to my order of {p}.",
        "I need a VAT invoice for {p} for my company.",
    ],
    "technical": [
        "{p} stops working after a few minutes.",
        "The light on {p} keeps blinking red.",
        "{p} does not connect to my phone any more.",
        "After the update {p} restarts by itself.",
        "{p} makes a loud clicking noise when switched on.",
        "The app shows an error code E42 for {p}.",
        "{p} gets very hot and then turns off.",
        "How do I reset {p} to factory settings? It freezes.",
    ],
    "account": [
        "I cannot log in to manage {p}.",
        "Please change the email address on the account I use for {p}.",
        "I forgot my password and the reset mail for {p} never arrives.",
        "How do I delete my account? I no longer use {p}.",
        "Someone else registered {p} under my name.",
        "Two-factor codes for my {p} account do not work.",
        "I want to add my partner as a second user of {p}.",
        "My account page for {p} is empty after I logged in.",
    ],
    "shipping": [
        "My order of {p} has not arrived after two weeks.",
        "The tracking number for {p} does not work.",
        "{p} arrived with a broken box.",
        "Can you deliver {p} to a different address?",
        "I received someone else's parcel instead of {p}.",
        "The courier left {p} at the wrong door.",
        "How long does shipping {p} to Norway take?",
        "Only half of my order of {p} was delivered.",
    ],
}


def make_rows() -> list[dict[str, str]]:
    rows = []
    for i in range(8):
        for product in PRODUCTS:
            for category, phrasings in TICKETS.items():
                ticket = phrasings[i].format(p=product)
                rows.append({"ticket": ticket[0].upper() + ticket[1:], "product": product, "category": category})
    return rows


def as_csv(rows: list[dict[str, str]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=["ticket", "product", "category"], lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def as_messages(rows: list[dict[str, str]]) -> str:
    lines = []
    for row in rows:
        turns = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": PROMPT.format(**row)},
            {"role": "assistant", "content": row["category"]},
        ]
        lines.append(json.dumps({"messages": turns}, ensure_ascii=False))
    return "\n".join(lines) + "\n"


def as_prompt_completion(rows: list[dict[str, str]]) -> str:
    lines = [
        json.dumps({"prompt": f"{SYSTEM}\n\n{PROMPT.format(**row)}", "completion": row["category"]}) for row in rows
    ]
    return "\n".join(lines) + "\n"


def as_sharegpt(rows: list[dict[str, str]]) -> str:
    lines = []
    for row in rows:
        turns = [("system", SYSTEM), ("human", PROMPT.format(**row)), ("gpt", row["category"])]
        conversations = [{"from": who, "value": text} for who, text in turns]
        lines.append(json.dumps({"conversations": conversations}, ensure_ascii=False))
    return "\n".join(lines) + "\n"


FILES = {
    "tickets.csv": as_csv,
    "tickets-messages.jsonl": as_messages,
    "tickets-prompt-completion.jsonl": as_prompt_completion,
    "tickets-sharegpt.jsonl": as_sharegpt,
}

if __name__ == "__main__":
    for name, render in FILES.items():
        (HERE / name).write_text(render(make_rows()), encoding="utf-8")
