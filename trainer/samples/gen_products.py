"""Generate trainer/samples/products.jsonl and the PNGs under trainer/samples/products/.

A tiny, deterministic stand-in for amazon-product-descriptions-vlm: each row has the
dataset's columns `Product Name`, `Category`, `description` and `image`, where `image` is a
path relative to this folder (trainer/samples/) of a 64x64 PNG drawn here with PIL: one coloured
shape on a light background. The description names the shape and the colour, so a model that
looks at the image can learn something real from it. All names and texts are made up from
templates; nothing is copied from the real dataset.

    python trainer/samples/gen_products.py               # rewrites products.jsonl and products/*.png
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent
OUT = HERE / "products.jsonl"
IMAGE_DIR = HERE / "products"
SIZE = 64
SEED = 11
N_ROWS = 36

COLOURS = {
    "red": (200, 40, 40),
    "blue": (40, 80, 200),
    "green": (40, 150, 70),
    "yellow": (230, 190, 30),
    "purple": (130, 60, 170),
    "orange": (235, 120, 30),
}
BACKGROUNDS = ((245, 245, 240), (235, 240, 248), (248, 240, 235))
SHAPES = ("circle", "square", "triangle", "diamond", "ring", "stripes")

# (category path, product nouns, a use that the description mentions)
CATEGORIES = (
    ("Home & Kitchen | Kitchen & Dining | Coasters", ("Coaster Set", "Trivet"), "protects your table from hot mugs"),
    ("Toys & Games | Puzzles | Wooden Puzzles", ("Shape Puzzle", "Stacking Block"), "helps toddlers learn shapes"),
    ("Office Products | Desk Accessories | Stickers", ("Sticker Pack", "Magnet"), "brightens a notebook or fridge"),
    ("Sports & Outdoors | Fitness | Exercise Mats", ("Balance Pad", "Floor Marker"), "marks stations in a workout"),
    ("Arts & Crafts | Sewing | Patches", ("Iron-on Patch", "Badge"), "adds a bold accent to a jacket or bag"),
    ("Home & Kitchen | Wall Art | Prints", ("Art Print", "Canvas Tile"), "gives a plain wall a modern touch"),
)
ADJECTIVES = ("Classic", "Bold", "Mini", "Everyday", "Studio", "Bright")
MATERIALS = ("cork", "birch wood", "vinyl", "recycled rubber", "cotton twill", "matte paper")


def draw(shape: str, colour: tuple[int, int, int], background: tuple[int, int, int], jitter: int) -> Image.Image:
    """One shape, centred with a small seeded offset, on a flat background."""
    image = Image.new("RGB", (SIZE, SIZE), background)
    pen = ImageDraw.Draw(image)
    lo, hi = 12 + jitter, 52 + jitter
    if shape == "circle":
        pen.ellipse((lo, lo, hi, hi), fill=colour)
    elif shape == "square":
        pen.rectangle((lo, lo, hi, hi), fill=colour)
    elif shape == "triangle":
        pen.polygon([(32 + jitter, lo), (hi, hi), (lo, hi)], fill=colour)
    elif shape == "diamond":
        mid = 32 + jitter
        pen.polygon([(mid, lo - 4), (hi + 4, mid), (mid, hi + 4), (lo - 4, mid)], fill=colour)
    elif shape == "ring":
        pen.ellipse((lo, lo, hi, hi), outline=colour, width=7)
    else:  # stripes
        for x in range(4 + jitter, SIZE, 14):
            pen.rectangle((x, 0, x + 6, SIZE), fill=colour)
    return image


def _description(name: str, colour: str, shape: str, use: str, material: str) -> str:
    article = "an" if shape[0] in "aeiou" else "a"
    return (
        f"The {name} features {article} {shape} design in vivid {colour}. Made from durable {material}, "
        f"it {use}. Easy to clean and sized to fit anywhere, it makes a cheerful gift for any occasion."
    )


def generate(seed: int = SEED) -> list[dict[str, str]]:
    """Write the PNGs and return the rows (the caller writes the JSONL)."""
    rng = random.Random(seed)
    IMAGE_DIR.mkdir(exist_ok=True)
    rows = []
    colour_names = list(COLOURS)
    for i in range(N_ROWS):
        shape = SHAPES[i % len(SHAPES)]
        colour = colour_names[(i // len(SHAPES) + i) % len(colour_names)]
        category, nouns, use = CATEGORIES[rng.randrange(len(CATEGORIES))]
        name = f"{rng.choice(ADJECTIVES)} {colour.title()} {shape.title()} {rng.choice(nouns)}"
        image = draw(shape, COLOURS[colour], BACKGROUNDS[i % len(BACKGROUNDS)], rng.randint(-3, 3))
        path = IMAGE_DIR / f"product_{i:03d}.png"
        image.quantize(colors=8).save(path, optimize=True)
        rows.append(
            {
                "Product Name": name,
                "Category": category,
                "description": _description(name, colour, shape, use, rng.choice(MATERIALS)),
                "image": path.relative_to(HERE).as_posix(),
            }
        )
    return rows


def main() -> None:
    rows = generate()
    OUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    total = sum(p.stat().st_size for p in IMAGE_DIR.glob("*.png"))
    print(f"wrote {len(rows)} rows to {OUT} and {total} bytes of PNG under {IMAGE_DIR}")


if __name__ == "__main__":
    main()
