"""Generate trainer/data/text_to_sql.jsonl: a small, deterministic text-to-SQL sample.

The rows follow the gretel-synthetic-text-to-sql schema (`sql_prompt`, `sql_context`, `sql`,
`domain` plus the other gretel columns) but every value is made up here from templates: ten
domains, each with an entity table and a lookup table, and ten question templates per domain
(counts, aggregates, top-N, MySQL date filters, joins, subqueries, window functions and
INSERT/UPDATE/DELETE). The gold SQL is MySQL-flavoured, as in gretel, and
tests/trainer/test_sql_eval.py checks that each gold query executes and matches itself.

    python trainer/data/gen_text_to_sql.py            # rewrites trainer/data/text_to_sql.jsonl
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


def _quote(value: object) -> str:
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return str(value)


def _context(d: Domain, rows: list[tuple[object, ...]]) -> str:
    measure_type = "DECIMAL(10,2)" if d.decimal else "INT"
    create_main = (
        f"CREATE TABLE {d.table} ({d.id_col} INT PRIMARY KEY, {d.name_col} VARCHAR(50), "
        f"{d.cat_col} VARCHAR(30), {d.measure_col} {measure_type}, {d.date_col} DATE);"
    )
    insert_main = (
        f"INSERT INTO {d.table} ({d.id_col}, {d.name_col}, {d.cat_col}, {d.measure_col}, {d.date_col}) VALUES "
        + (", ".join("(" + ", ".join(_quote(v) for v in row) + ")" for row in rows) + ";")
    )
    create_lookup = f"CREATE TABLE {d.lookup} ({d.cat_col} VARCHAR(30) PRIMARY KEY, {d.attr_col} VARCHAR(30));"
    insert_lookup = f"INSERT INTO {d.lookup} ({d.cat_col}, {d.attr_col}) VALUES " + (
        ", ".join(f"({_quote(c)}, {_quote(a)})" for c, a in zip(d.categories, d.attrs, strict=True)) + ";"
    )
    return " ".join([create_main, insert_main, create_lookup, insert_lookup])


def _rows(d: Domain, rng: random.Random) -> list[tuple[object, ...]]:
    lo, hi = d.measure_range
    measures = rng.sample(range(lo * 100, hi * 100), len(d.names))  # distinct: top-N has no ties
    start = date(2021, 1, 1)
    rows = []
    for i, name in enumerate(d.names, start=1):
        measure: object = round(measures[i - 1] / 100, 2) if d.decimal else measures[i - 1] // 100
        when = start + timedelta(days=rng.randrange(0, 5 * 365))
        rows.append((i, name, d.categories[(i - 1) % len(d.categories)], measure, when.isoformat()))
    return rows


def _questions(d: Domain, rows: list[tuple[object, ...]], rng: random.Random) -> list[dict[str, str]]:
    cat = rng.choice(d.categories)
    attr = d.attrs[d.categories.index(cat)]
    n_top = rng.choice((2, 3))
    years = rng.choice((1, 2, 3))
    cutoff_year = rng.choice((2022, 2023))
    row_id, name = rows[rng.randrange(len(rows))][:2]
    pct = rng.choice((5, 10, 15))
    new_id = len(rows) + 1
    t, m = d.table, d.measure_col
    return [
        dict(
            prompt=f"How many {d.entity_word} are in the {cat} {d.cat_col.replace('_', ' ')}?",
            sql=f"SELECT COUNT(*) FROM {t} WHERE {d.cat_col} = '{cat}';",
            complexity="aggregation",
            task="analytics and reporting",
            explain=f"Counts the rows of {t} whose {d.cat_col} is {cat}.",
        ),
        dict(
            prompt=f"What is the average {d.measure_word} per {d.cat_col.replace('_', ' ')}?",
            sql=f"SELECT {d.cat_col}, AVG({m}) AS avg_{m} FROM {t} GROUP BY {d.cat_col};",
            complexity="aggregation",
            task="analytics and reporting",
            explain=f"Groups {t} by {d.cat_col} and averages {m} in each group.",
        ),
        dict(
            prompt=f"List the {n_top} {d.entity_word} with the highest {d.measure_word}.",
            sql=f"SELECT {d.name_col}, {m} FROM {t} ORDER BY {m} DESC LIMIT {n_top};",
            complexity="basic SQL",
            task="data retrieval",
            explain=f"Sorts {t} by {m} from high to low and keeps the first {n_top} rows.",
        ),
        dict(
            prompt=f"What is the total {d.measure_word} of {d.entity_word} dated within the last {years} year(s)?",
            sql=f"SELECT SUM({m}) FROM {t} WHERE {d.date_col} >= DATE_SUB(CURDATE(), INTERVAL {years} YEAR);",
            complexity="aggregation",
            task="analytics and reporting",
            explain=f"Sums {m} over rows whose {d.date_col} is at most {years} year(s) before today.",
        ),
        dict(
            prompt=f"How many {d.entity_word} are there per year of {d.date_col.replace('_', ' ')}, oldest year first?",
            sql=f"SELECT YEAR({d.date_col}) AS yr, COUNT(*) AS n FROM {t} GROUP BY YEAR({d.date_col}) ORDER BY yr;",
            complexity="aggregation",
            task="analytics and reporting",
            explain=f"Extracts the year of {d.date_col}, counts rows per year and sorts by year.",
        ),
        dict(
            prompt=f"Which {d.entity_word} belong to a {d.cat_col.replace('_', ' ')} whose {d.attr_col.replace('_', ' ')} is {attr}?",
            sql=(
                f"SELECT {t}.{d.name_col} FROM {t} JOIN {d.lookup} ON {t}.{d.cat_col} = {d.lookup}.{d.cat_col} "
                f"WHERE {d.lookup}.{d.attr_col} = '{attr}';"
            ),
            complexity="single join",
            task="data retrieval",
            explain=f"Joins {t} with {d.lookup} on {d.cat_col} and filters on {d.attr_col}.",
        ),
        dict(
            prompt=f"Which {d.entity_word} have a {d.measure_word} above the overall average?",
            sql=f"SELECT {d.name_col} FROM {t} WHERE {m} > (SELECT AVG({m}) FROM {t});",
            complexity="subqueries",
            task="data retrieval",
            explain=f"Compares each row's {m} with the average computed by a subquery.",
        ),
        dict(
            prompt=f"Rank the {d.entity_word} by {d.measure_word} within each {d.cat_col.replace('_', ' ')}.",
            sql=(
                f"SELECT {d.name_col}, {d.cat_col}, RANK() OVER (PARTITION BY {d.cat_col} ORDER BY {m} DESC) AS rnk "
                f"FROM {t};"
            ),
            complexity="window functions",
            task="analytics and reporting",
            explain=f"RANK over a partition per {d.cat_col}, highest {m} first.",
        ),
        dict(
            prompt=f"Increase the {d.measure_word} of {name} by {pct} percent.",
            sql=f"UPDATE {t} SET {m} = {m} * {1 + pct / 100:.2f} WHERE {d.id_col} = {row_id};",
            complexity="basic SQL",
            task="data manipulation",
            explain=f"Multiplies {m} by {1 + pct / 100:.2f} for the row with {d.id_col} {row_id}.",
        ),
        dict(
            prompt=f"Delete the {d.entity_word} dated before {cutoff_year}.",
            sql=f"DELETE FROM {t} WHERE {d.date_col} < '{cutoff_year}-01-01';",
            complexity="basic SQL",
            task="data manipulation",
            explain=f"Removes rows whose {d.date_col} falls before January 1st, {cutoff_year}.",
        ),
        dict(
            prompt=f"Add a new record {new_id} named 'New {d.entity_word.split()[-1].rstrip('s')}' in {cat}, "
            f"with a {d.measure_word} of {d.measure_range[0]}, dated today.",
            sql=(
                f"INSERT INTO {t} ({d.id_col}, {d.name_col}, {d.cat_col}, {m}, {d.date_col}) VALUES "
                f"({new_id}, 'New {d.entity_word.split()[-1].rstrip('s')}', '{cat}', {d.measure_range[0]}, CURDATE());"
            ),
            complexity="basic SQL",
            task="data manipulation",
            explain=f"Inserts one row into {t} with today's date.",
        ),
    ]


def generate(seed: int = SEED) -> list[dict[str, object]]:
    rng = random.Random(seed)
    out: list[dict[str, object]] = []
    for d in DOMAINS:
        rows = _rows(d, rng)
        context = _context(d, rows)
        for q in _questions(d, rows, rng):
            out.append(
                {
                    "id": len(out) + 1,
                    "domain": d.domain,
                    "domain_description": d.description,
                    "sql_complexity": q["complexity"],
                    "sql_complexity_description": COMPLEXITY[q["complexity"]],
                    "sql_task_type": q["task"],
                    "sql_task_type_description": TASK_TYPES[q["task"]],
                    "sql_prompt": q["prompt"],
                    "sql_context": context,
                    "sql": q["sql"],
                    "sql_explanation": q["explain"],
                }
            )
    return out


def main() -> None:
    rows = generate()
    OUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows to {OUT}")


if __name__ == "__main__":
    main()
