"""Generate trainer/samples/text_to_sql.jsonl: a small, deterministic text-to-SQL sample with gretel's length spread.

    python trainer/samples/gen_text_to_sql.py            # rewrites trainer/samples/text_to_sql.jsonl

The rows follow the gretel-synthetic-text-to-sql schema, every value made up from templates (ten domains,
thirteen question templates from a COUNT to joins, window functions and INSERT/UPDATE/DELETE); the gold SQL is
MySQL-flavoured, as in gretel, and tests/trainer/test_sql_eval.py checks each gold query matches itself.

Decision: like gretel, each row carries its own `sql_context`; what spreads the lengths (rows inserted
`ROW_COUNTS`/`ROW_WEIGHTS`, extra columns, an unused lookup table, the query's size) is drawn per row with a
fixed seed, to the dataset card's scale with a long right tail. The card's totals, our reading of them
(UNCONFIRMED) and the sample's lengths: docs/trainer.md#the-bundled-samples. Not matched: gretel's vocabulary
or its 100 domains; 120 rows cannot show a distribution's far tail.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path

OUT = Path(__file__).resolve().parent / "text_to_sql.jsonl"
SEED = 7


@dataclass(frozen=True)
class Domain:
    domain: str
    description: str
    table: str  # entity table
    id_col: str
    name_col: str
    names: tuple[str, ...]
    cat_col: str  # category column, also the key of the lookup table
    categories: tuple[str, ...]
    measure_col: str
    measure_word: str  # how a question names the measure
    measure_range: tuple[int, int]
    decimal: bool
    date_col: str
    entity_word: str  # plural noun for the entity
    lookup: str  # lookup table
    attr_col: str
    attrs: tuple[str, ...]


# fmt: off
DOMAINS = (
    Domain("retail", "Store catalogues, departments and prices.", "products", "product_id", "product_name",
           ("Trail Mug", "Desk Lamp", "Wool Scarf", "Garden Hose", "Chess Set", "Rain Jacket", "Bread Knife", "Yoga Mat"),
           "department", ("Kitchen", "Outdoor", "Apparel", "Games"), "price", "price", (5, 120), True,
           "listed_on", "products", "departments", "floor_manager", ("Ines", "Marek", "Tomas", "Lea")),
    Domain("healthcare", "Clinic visits, costs and locations.", "visits", "visit_id", "patient_name",
           ("Ada Ruiz", "Ben Okafor", "Chen Li", "Dara Novak", "Eli Haddad", "Fay Moreau", "Gus Berg", "Hana Sato"),
           "clinic", ("Northside", "Riverside", "Hilltop"), "cost", "cost", (40, 900), True,
           "visit_date", "visits", "clinics", "city", ("Porto", "Leeds", "Graz")),
    Domain("energy", "Power plants, energy sources and capacity.", "plants", "plant_id", "plant_name",
           ("Ridge One", "Bay Array", "Delta Hydro", "Mesa Field", "North Wind", "Cedar Station", "Lake Dam"),
           "source_type", ("Solar", "Wind", "Hydro", "Gas"), "capacity_mw", "capacity in MW", (20, 800), False,
           "commissioned_on", "power plants", "source_types", "grid_region", ("West", "East", "Central", "South")),
    Domain("education", "University courses, faculties and enrolments.", "courses", "course_id", "course_title",
           ("Algebra I", "Data Ethics", "Modern Poetry", "Cell Biology", "Macroeconomics", "Film Studies", "Robotics"),
           "faculty", ("Science", "Arts", "Economics"), "enrolled", "enrolment", (12, 300), False,
           "start_date", "courses", "faculties", "dean", ("Dr. Alvarez", "Dr. Kimura", "Dr. Osei")),
    Domain("finance", "Account transactions by channel.", "transactions", "txn_id", "account_holder",
           ("Mila Roth", "Noah Diaz", "Olga Petrov", "Pablo Reyes", "Quinn Ash", "Rosa Lind", "Sami Karimi"),
           "channel", ("Online", "Branch", "ATM", "Mobile"), "amount", "amount", (10, 5000), True,
           "txn_date", "transactions", "channels", "fee_tier", ("Low", "Standard", "Free", "Premium")),
    Domain("agriculture", "Farm harvests, crops and yields.", "harvests", "harvest_id", "farm_name",
           ("Green Acre", "Oak Valley", "Sunny Slope", "Clearwater", "Red Barn", "Maple Ridge", "Stone Creek"),
           "crop", ("Wheat", "Barley", "Maize", "Soy"), "yield_tons", "yield in tons", (3, 95), True,
           "harvest_date", "harvests", "crops", "season", ("Winter", "Spring", "Summer", "Autumn")),
    Domain("sports", "League matches, teams and points.", "matches", "match_id", "team_name",
           ("Falcons", "Rovers", "Comets", "Pioneers", "Harbour FC", "Miners", "Tigers", "Wolves"),
           "league", ("Premier", "Championship", "Youth"), "points", "points", (0, 9), False,
           "match_date", "matches", "leagues", "country", ("Spain", "Kenya", "Canada")),
    Domain("museums", "Exhibitions, galleries and visitor numbers.", "exhibits", "exhibit_id", "exhibit_title",
           ("Bronze Age", "Silk Roads", "Deep Sea", "Early Flight", "Ink and Paper", "Glass Works", "Star Maps"),
           "gallery", ("East Hall", "West Hall", "Annex"), "visitors", "visitors", (150, 9000), False,
           "opened_on", "exhibits", "galleries", "wing", ("North", "South", "Garden")),
    Domain("telecom", "Mobile subscribers, plans and data usage.", "subscribers", "subscriber_id", "subscriber_name",
           ("Tara Quinn", "Umar Shah", "Vera Holm", "Wes Park", "Xin Zhao", "Yara Costa", "Zane Cole"),
           "plan", ("Basic", "Plus", "Unlimited"), "data_gb", "data usage in GB", (1, 80), True,
           "joined_on", "subscribers", "plans", "network", ("4G", "5G", "5G")),
    Domain("aviation", "Flights, airlines and delays.", "flights", "flight_id", "flight_code",
           ("AX101", "BR220", "CK315", "DL404", "EF512", "GH618", "JK707", "LM880"),
           "airline", ("Aerolux", "Bluejet", "Coastair"), "delay_minutes", "delay in minutes", (0, 240), False,
           "flight_date", "flights", "airlines", "hub_city", ("Lisbon", "Oslo", "Nairobi")),
)
# fmt: on

COMPLEXITY = {
    "basic SQL": "basic SQL with a simple select statement",
    "aggregation": "aggregation functions (COUNT, SUM, AVG, MIN, MAX) and GROUP BY",
    "single join": "only one join (inner, left, right or full)",
    "subqueries": "subqueries, including correlated and nested subqueries",
    "window functions": "window functions (RANK, ROW_NUMBER, …) with partitioning and ordering",
}
TASK_TYPES = {
    "analytics and reporting": "generating reports, dashboards and analytical insights",
    "data manipulation": "inserting, updating or deleting records",
    "data retrieval": "basic data fetching queries",
}


ROW_COUNTS = (1, 2, 3, 4, 5, 6, 8, 10, 14)
ROW_WEIGHTS = (40, 35, 12, 5, 3, 2, 1, 1, 1)
OPTIONAL_COLUMN_PROBABILITY = 0.2
UNUSED_LOOKUP_PROBABILITY = 0.1
JOIN_EVERY = 5  # one row in 5 joins the lookup table (gretel: ~20% of queries join)


def _quote(value: object) -> str:
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return str(value)


def _insert(table: str, columns: list[str], rows: list[tuple[object, ...]]) -> str:
    values = ", ".join("(" + ", ".join(_quote(v) for v in row) + ")" for row in rows)
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES {values};"


def _entity_context(d: Domain, rows: list[dict[str, object]], columns: list[str]) -> str:
    types = {
        d.id_col: "INT PRIMARY KEY",
        d.name_col: "VARCHAR(50)",
        d.cat_col: "VARCHAR(30)",
        d.measure_col: "DECIMAL(10,2)" if d.decimal else "INT",
        d.date_col: "DATE",
    }
    create = f"CREATE TABLE {d.table} (" + ", ".join(f"{c} {types[c]}" for c in columns) + ");"
    return create + " " + _insert(d.table, columns, [tuple(row[c] for c in columns) for row in rows])


def _lookup_context(d: Domain) -> str:
    create = f"CREATE TABLE {d.lookup} ({d.cat_col} VARCHAR(30) PRIMARY KEY, {d.attr_col} VARCHAR(30));"
    return create + " " + _insert(d.lookup, [d.cat_col, d.attr_col], list(zip(d.categories, d.attrs, strict=True)))


def _rows(d: Domain, count: int, rng: random.Random) -> list[dict[str, object]]:
    lo, hi = d.measure_range
    measures = rng.sample(range(lo * 100, hi * 100), count)  # distinct: top-N has no ties
    start = date(2021, 1, 1)
    rows = []
    for i in range(1, count + 1):
        base = d.names[(i - 1) % len(d.names)]
        name = base if i <= len(d.names) else f"{base} {(i - 1) // len(d.names) + 1}"
        measure: object = round(measures[i - 1] / 100, 2) if d.decimal else measures[i - 1] // 100
        rows.append(
            {
                d.id_col: i,
                d.name_col: name,
                d.cat_col: rng.choice(d.categories),
                d.measure_col: measure,
                d.date_col: (start + timedelta(days=rng.randrange(0, 5 * 365))).isoformat(),
            }
        )
    return rows


@dataclass(frozen=True)
class Question:
    prompt: str
    sql: str
    complexity: str
    task: str
    explain: str
    reads: tuple[str, ...]  # entity-table columns the query names (besides the id)
    joins: bool = False


def _questions(d: Domain, rows: list[dict[str, object]], rng: random.Random) -> list[Question]:
    """The templates that make sense for these rows (top-N needs N rows, a join needs the category present, ...)."""
    t, m, c, n = d.table, d.measure_col, d.cat_col, d.name_col
    present = sorted({str(r[c]) for r in rows})
    cat = rng.choice(present)
    attr = d.attrs[d.categories.index(cat)]
    row = rng.choice(rows)
    years, cutoff_year, pct = rng.choice((1, 2, 3)), rng.choice((2022, 2023)), rng.choice((5, 10, 15))
    word, cat_word, measure_word = d.entity_word, c.replace("_", " "), d.measure_word
    singular = word.split()[-1].rstrip("s")
    new_id = len(rows) + 1
    questions = [
        Question(
            f"How many {word} are in the {cat} {cat_word}?",
            f"SELECT COUNT(*) FROM {t} WHERE {c} = '{cat}';",
            "aggregation", "analytics and reporting", f"Counts the rows of {t} whose {c} is {cat}.", (c,),
        ),
        Question(
            f"What is the average {measure_word} per {cat_word}?",
            f"SELECT {c}, AVG({m}) AS avg_{m} FROM {t} GROUP BY {c};",
            "aggregation", "analytics and reporting", f"Groups {t} by {c} and averages {m} in each group.", (c, m),
        ),
        Question(
            f"What is the total {measure_word} of {word} dated within the last {years} year(s)?",
            f"SELECT SUM({m}) FROM {t} WHERE {d.date_col} >= DATE_SUB(CURDATE(), INTERVAL {years} YEAR);",
            "aggregation", "analytics and reporting",
            f"Sums {m} over rows whose {d.date_col} is at most {years} year(s) before today.", (m, d.date_col),
        ),
        Question(
            f"How many {word} are there per year of {d.date_col.replace('_', ' ')}, oldest year first?",
            f"SELECT YEAR({d.date_col}) AS yr, COUNT(*) AS n FROM {t} GROUP BY YEAR({d.date_col}) ORDER BY yr;",
            "aggregation", "analytics and reporting",
            f"Extracts the year of {d.date_col}, counts rows per year and sorts by year.", (d.date_col,),
        ),
        Question(
            f"Which {word} belong to a {cat_word} whose {d.attr_col.replace('_', ' ')} is {attr}?",
            f"SELECT {t}.{n} FROM {t} JOIN {d.lookup} ON {t}.{c} = {d.lookup}.{c} WHERE {d.lookup}.{d.attr_col} = '{attr}';",
            "single join", "data retrieval", f"Joins {t} with {d.lookup} on {c} and filters on {d.attr_col}.", (n, c),
            joins=True,
        ),
        Question(
            f"For each {d.attr_col.replace('_', ' ')}, how many {word} are there and what is their total {measure_word}?",
            f"SELECT {d.lookup}.{d.attr_col}, COUNT({t}.{d.id_col}) AS n, SUM({t}.{m}) AS total_{m} FROM {t} "
            f"JOIN {d.lookup} ON {t}.{c} = {d.lookup}.{c} GROUP BY {d.lookup}.{d.attr_col} "
            f"ORDER BY total_{m} DESC;",
            "single join", "analytics and reporting",
            f"Joins {t} with {d.lookup}, then counts rows and sums {m} per {d.attr_col}.", (c, m),
            joins=True,
        ),
        Question(
            f"Increase the {measure_word} of {row[n]} by {pct} percent.",
            f"UPDATE {t} SET {m} = {m} * {1 + pct / 100:.2f} WHERE {d.id_col} = {row[d.id_col]};",
            "basic SQL", "data manipulation",
            f"Multiplies {m} by {1 + pct / 100:.2f} for the row with {d.id_col} {row[d.id_col]}.", (n, m),
        ),
        Question(
            f"Delete the {word} dated before {cutoff_year}.",
            f"DELETE FROM {t} WHERE {d.date_col} < '{cutoff_year}-01-01';",
            "basic SQL", "data manipulation",
            f"Removes rows whose {d.date_col} falls before January 1st, {cutoff_year}.", (d.date_col,),
        ),
        Question(
            f"Add a new record {new_id} named 'New {singular}' in {cat}, with a {measure_word} of "
            f"{d.measure_range[0]}, dated today.",
            f"INSERT INTO {t} ({d.id_col}, {n}, {c}, {m}, {d.date_col}) VALUES "
            f"({new_id}, 'New {singular}', '{cat}', {d.measure_range[0]}, CURDATE());",
            "basic SQL", "data manipulation", f"Inserts one row into {t} with today's date.", (n, c, m, d.date_col),
        ),
    ]  # fmt: skip
    if len(rows) >= 3:
        n_top = rng.choice((2, 3))
        questions.append(
            Question(
                f"List the {n_top} {word} with the highest {measure_word}.",
                f"SELECT {n}, {m} FROM {t} ORDER BY {m} DESC LIMIT {n_top};",
                "basic SQL", "data retrieval", f"Sorts {t} by {m} from high to low and keeps the first {n_top} rows.",
                (n, m),
            )
        )  # fmt: skip
    if len(rows) >= 2:
        questions += [
            Question(
                f"Which {word} have a {measure_word} above the overall average?",
                f"SELECT {n} FROM {t} WHERE {m} > (SELECT AVG({m}) FROM {t});",
                "subqueries", "data retrieval", f"Compares each row's {m} with the average computed by a subquery.",
                (n, m),
            ),
            Question(
                f"Rank the {word} by {measure_word} within each {cat_word}.",
                f"SELECT {n}, {c}, RANK() OVER (PARTITION BY {c} ORDER BY {m} DESC) AS rnk FROM {t};",
                "window functions", "analytics and reporting", f"RANK over a partition per {c}, highest {m} first.",
                (n, c, m),
            ),
        ]  # fmt: skip
    counts = {k: sum(1 for r in rows if r[c] == k) for k in present}
    if max(counts.values()) >= 2:
        questions.append(
            Question(
                f"Which {cat_word} values have more than one {singular.lower()}, and what is the highest "
                f"{measure_word} in each?",
                f"SELECT {c}, COUNT(*) AS n, MAX({m}) AS max_{m} FROM {t} GROUP BY {c} HAVING COUNT(*) > 1;",
                "aggregation", "analytics and reporting",
                f"Groups {t} by {c}, keeps groups of more than one row and reports their largest {m}.", (c, m),
            )
        )  # fmt: skip
    return questions


def _record(d: Domain, rng: random.Random, index: int) -> dict[str, object]:
    """One gretel-like row: its own rows, the columns and tables its query needs, and its query."""
    rows = _rows(d, rng.choices(ROW_COUNTS, weights=ROW_WEIGHTS)[0], rng)
    candidates = _questions(d, rows, rng)
    joins = [q for q in candidates if q.joins]
    others = [q for q in candidates if not q.joins]
    # every JOIN_EVERY-th row joins, the others cycle through what these rows allow
    if index % JOIN_EVERY == JOIN_EVERY - 1:
        q = joins[index // JOIN_EVERY % len(joins)]
    else:
        q = others[(index * 5 + rng.randrange(len(others))) % len(others)]
    optional = [col for col in (d.name_col, d.cat_col, d.measure_col, d.date_col) if col not in q.reads]
    kept = {col for col in optional if rng.random() < OPTIONAL_COLUMN_PROBABILITY} | set(q.reads)
    columns = [d.id_col] + [col for col in (d.name_col, d.cat_col, d.measure_col, d.date_col) if col in kept]
    context = _entity_context(d, rows, columns)
    if q.joins or rng.random() < UNUSED_LOOKUP_PROBABILITY:
        context += " " + _lookup_context(d)
    return {
        "domain": d.domain,
        "domain_description": d.description,
        "sql_complexity": q.complexity,
        "sql_complexity_description": COMPLEXITY[q.complexity],
        "sql_task_type": q.task,
        "sql_task_type_description": TASK_TYPES[q.task],
        "sql_prompt": q.prompt,
        "sql_context": context,
        "sql": q.sql,
        "sql_explanation": q.explain,
    }


ROWS_PER_DOMAIN = 12


def generate(seed: int = SEED) -> list[dict[str, object]]:
    rng = random.Random(seed)
    out: list[dict[str, object]] = []
    for d in DOMAINS:
        for _ in range(ROWS_PER_DOMAIN):
            out.append({"id": len(out) + 1, **_record(d, rng, len(out))})
    return out


def main() -> None:
    rows = generate()
    OUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows to {OUT}")


if __name__ == "__main__":
    main()
