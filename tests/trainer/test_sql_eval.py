"""The text-to-SQL execution evaluator: hand-made cases plus every bundled sample row.

Why it matters: execution accuracy is the number we report for the text-to-SQL run. A judge
that hangs on a runaway query, crashes on invalid SQL or calls a reordered answer wrong
(or right) would make that number meaningless.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from trainer.sql_eval import Reason, evaluate_sql, execution_match, to_sqlite

DATA = Path(__file__).resolve().parents[2] / "trainer" / "data"
NOW = datetime(2024, 3, 10, 12, 0, 0)
CONTEXT = """
CREATE TABLE orders (id INT PRIMARY KEY AUTO_INCREMENT, customer VARCHAR(20), amount DECIMAL(10,2),
                     order_date DATE, status ENUM('open','closed'));
INSERT INTO orders VALUES (1,'ana',10.5,'2024-01-15','open'),(2,'bo',20,'2024-03-01','closed'),
                          (3,'ana',5,'2023-12-30','open'),(4,'cy',7.25,'2022-06-30','closed');
CREATE TABLE customers (name VARCHAR(20) PRIMARY KEY, city VARCHAR(20));
INSERT INTO customers VALUES ('ana','Porto'),('bo','Oslo'),('cy','Porto');
"""


def judge(pred: str, gold: str, context: str = CONTEXT, timeout_s: float = 2.0):
    return evaluate_sql(pred, gold, context, timeout_s, now=NOW)


def _load_generator(name: str):
    spec = importlib.util.spec_from_file_location(name, DATA / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


class TestMatches:
    def test_equivalent_queries_with_different_aliases_match(self):
        r = judge(
            "SELECT customer, SUM(amount) FROM orders GROUP BY customer",
            "SELECT customer AS c, SUM(amount) AS total FROM orders GROUP BY 1",
        )
        assert r.match and r.reason is Reason.OK

    def test_join_and_subquery_forms_match(self):
        assert execution_match(
            "SELECT o.id FROM orders o JOIN customers c ON o.customer = c.name WHERE c.city = 'Porto'",
            "SELECT id FROM orders WHERE customer IN (SELECT name FROM customers WHERE city = 'Porto')",
            CONTEXT,
        )

    def test_integer_and_decimal_results_compare_as_numbers(self):
        assert judge("SELECT 20.0", "SELECT amount FROM orders WHERE id = 2").match

    def test_different_rows_mismatch(self):
        r = judge("SELECT id FROM orders WHERE status = 'open'", "SELECT id FROM orders")
        assert not r.match and r.reason is Reason.MISMATCH

    def test_duplicates_count_in_the_multiset(self):
        r = judge("SELECT customer FROM orders", "SELECT DISTINCT customer FROM orders")
        assert r.reason is Reason.MISMATCH


class TestOrdering:
    def test_order_ignored_when_gold_has_no_order_by(self):
        assert judge("SELECT id FROM orders ORDER BY amount DESC", "SELECT id FROM orders").match

    def test_order_enforced_when_gold_has_order_by(self):
        r = judge("SELECT id FROM orders ORDER BY amount DESC", "SELECT id FROM orders ORDER BY amount")
        assert not r.match and r.reason is Reason.MISMATCH
        assert judge("SELECT id FROM orders ORDER BY amount ASC", "SELECT id FROM orders ORDER BY amount").match

    def test_order_by_inside_a_subquery_does_not_make_the_result_ordered(self):
        gold = "SELECT id FROM (SELECT id FROM orders ORDER BY amount LIMIT 3) t"
        assert judge("SELECT id FROM orders WHERE id IN (1, 3, 4) ORDER BY id DESC", gold).match


class TestMySqlDates:
    def test_curdate_and_date_sub_interval(self):
        r = judge(
            "SELECT id FROM orders WHERE order_date >= DATE_SUB(CURDATE(), INTERVAL 60 DAY)",
            "SELECT id FROM orders WHERE order_date >= '2024-01-10'",
        )
        assert r.match, r

    def test_now_minus_interval_equals_date_sub(self):
        assert judge(
            "SELECT id FROM orders WHERE order_date > NOW() - INTERVAL 3 MONTH",
            "SELECT id FROM orders WHERE order_date > DATE_SUB(NOW(), INTERVAL 3 MONTH)",
        ).match

    def test_year_and_extract(self):
        assert judge(
            "SELECT COUNT(*) FROM orders WHERE YEAR(order_date) = 2024",
            "SELECT COUNT(*) FROM orders WHERE EXTRACT(YEAR FROM order_date) = 2024",
        ).match
        assert judge("SELECT COUNT(*) FROM orders WHERE YEAR(order_date) = 2024", "SELECT 2").match

    def test_date_add_month_clamps_to_month_end(self):
        assert judge("SELECT DATE_ADD('2024-01-31', INTERVAL 1 MONTH)", "SELECT '2024-02-29'").match

    def test_current_date_follows_the_frozen_clock(self):
        assert judge("SELECT CURRENT_DATE", "SELECT '2024-03-10'").match
        assert judge("SELECT YEAR(NOW()), MONTH(CURDATE())", "SELECT 2024, 3").match

    def test_datediff_and_timestampdiff(self):
        assert judge(
            "SELECT TIMESTAMPDIFF(DAY, '2024-01-01', order_date) FROM orders",
            "SELECT DATEDIFF(order_date, '2024-01-01') FROM orders",
        ).match

    def test_transpiled_sql_has_no_mysql_interval(self):
        (sql,) = to_sqlite("SELECT * FROM t WHERE d >= DATE_SUB(CURDATE(), INTERVAL 7 DAY)")
        assert "INTERVAL" not in sql.upper() and "MYSQL_DATE_ADD(CURDATE()" in sql


class TestDataManipulation:
    def test_dml_compared_by_resulting_tables(self):
        assert judge("DELETE FROM orders WHERE status = 'closed'", "DELETE FROM orders WHERE id IN (2, 4)").match
        r = judge("DELETE FROM orders WHERE status = 'open'", "DELETE FROM orders WHERE id IN (2, 4)")
        assert r.reason is Reason.MISMATCH

    def test_select_is_not_a_dml_answer(self):
        assert judge("SELECT * FROM orders", "UPDATE orders SET amount = 0").reason is Reason.MISMATCH


class TestFailures:
    @pytest.mark.parametrize("pred", ["SELEC id FROM orders", "SELECT nope FROM orders", "", "   ;", "DROP"])
    def test_invalid_sql_is_false_with_reason(self, pred):
        r = judge(pred, "SELECT id FROM orders")
        assert not r.match and r.reason is Reason.INVALID_SQL, r

    @pytest.mark.parametrize(
        "pred",
        [
            "WITH RECURSIVE c(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM c) SELECT COUNT(*) FROM c",
            "SELECT COUNT(*) FROM orders a, orders b, orders c, orders d, orders e, orders f, orders g, orders h, "
            "orders i, orders j, orders k, orders l, orders m, orders n, orders o, orders p",
        ],
        ids=["endless-recursive-cte", "huge-cross-join"],
    )
    def test_runaway_query_stops_at_the_budget(self, pred):
        start = time.monotonic()
        r = judge(pred, "SELECT 1", timeout_s=0.3)
        assert not r.match and r.reason is Reason.TIMEOUT, r
        assert time.monotonic() - start < 3

    def test_huge_result_is_cut_off(self):
        pred = "WITH RECURSIVE c(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM c LIMIT 500) SELECT n FROM c"
        r = evaluate_sql(pred, "SELECT 1", CONTEXT, now=NOW, max_rows=100)
        assert r.reason is Reason.TOO_LARGE

    def test_broken_context(self):
        r = judge("SELECT 1", "SELECT 1", context="CREATE TABLE (")
        assert not r.match and r.reason is Reason.CONTEXT_ERROR

    def test_broken_gold(self):
        r = judge("SELECT 1", "SELECT missing FROM orders")
        assert not r.match and r.reason is Reason.GOLD_ERROR

    def test_sql_injection_style_input_does_not_escape(self):
        r = judge("SELECT 1; ATTACH DATABASE '/tmp/x.db' AS x", "SELECT 1")
        assert not r.match


SAMPLE_ROWS = [json.loads(line) for line in (DATA / "text_to_sql.jsonl").read_text().splitlines()]


class TestSampleData:
    def test_schema_and_size(self):
        assert 90 <= len(SAMPLE_ROWS) <= 130
        for row in SAMPLE_ROWS:
            assert {"sql_prompt", "sql_context", "sql", "domain"} <= set(row)
            assert "CREATE TABLE" in row["sql_context"] and "INSERT INTO" in row["sql_context"]
        assert len({r["domain"] for r in SAMPLE_ROWS}) >= 8

    def test_every_gold_query_matches_itself(self):
        failures = [
            (row["id"], result)
            for row in SAMPLE_ROWS
            if not (result := evaluate_sql(row["sql"], row["sql"], row["sql_context"]))
        ]
        assert not failures

    def test_gold_queries_return_rows_or_change_tables(self):
        """A gold query that returns nothing would make any empty answer count as right."""
        empty = [
            row["id"]
            for row in SAMPLE_ROWS
            if row["sql"].startswith("SELECT")
            and evaluate_sql("SELECT 1 WHERE 0", row["sql"], row["sql_context"], now=NOW).match
        ]
        assert not empty

    def test_file_is_what_the_generator_writes(self):
        generated = _load_generator("gen_text_to_sql").generate()
        assert generated == SAMPLE_ROWS
