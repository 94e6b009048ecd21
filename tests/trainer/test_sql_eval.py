"""The text-to-SQL execution evaluator: hand-made cases plus every bundled sample row.

Why it matters: execution accuracy is the number we report for the text-to-SQL run. A judge
that hangs on a runaway query, crashes on invalid SQL or calls a reordered answer wrong
(or right) would make that number meaningless.
"""

from __future__ import annotations

import importlib.util
import json
import sqlite3
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from trainer.sql_eval import MYSQL_FUNCTIONS, Reason, evaluate_sql, execution_match, sandboxed_connection, to_sqlite

DATA = Path(__file__).resolve().parents[2] / "trainer" / "samples"
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
        # the CPU time this process spent, not the wall clock: a busy machine stretches the wall time of a
        # 0.3 s budget, while a budget that did not stop the query would keep burning CPU here
        start = time.process_time()
        r = judge(pred, "SELECT 1", timeout_s=0.3)
        assert not r.match and r.reason is Reason.TIMEOUT, r
        assert time.process_time() - start < 3

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


def _files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*"))


# Each prediction tries to write `{path}` (or something next to it). `{path}` is a file in an empty folder,
# and the working directory is that folder too, so a relative name would land there as well.
ESCAPES = {
    "vacuum-into-then-select": "VACUUM INTO '{path}'; SELECT COUNT(*) FROM orders",
    "vacuum-into-alone": "VACUUM INTO '{path}'",
    "select-then-vacuum-into": "SELECT COUNT(*) FROM orders; VACUUM INTO '{path}'",
    "vacuum-into-relative": "vacuum into 'escaped.db'; SELECT 4",
    "attach-database-then-select": "ATTACH DATABASE '{path}' AS x; SELECT COUNT(*) FROM orders",
    "attach-lowercase-no-keyword": "attach '{path}' as x; SELECT 4",
    "select-then-attach": "SELECT COUNT(*) FROM orders; ATTACH '{path}' AS x",
    "attach-after-comment-then-write": "/* hi */ ATTACH '{path}' AS x; CREATE TABLE x.t (a INT); SELECT 4",
    "attach-uri": "ATTACH 'file:{path}?mode=rwc' AS x; SELECT 4",
    "pragma-journal-mode": "PRAGMA journal_mode = WAL; SELECT 4",
    "pragma-user-version": "PRAGMA user_version = 7",
    "pragma-writable-schema": "PRAGMA writable_schema = ON; SELECT 4",
    "load-extension": "SELECT load_extension('{path}')",
    "load-extension-in-where": "SELECT COUNT(*) FROM orders WHERE load_extension('{path}') IS NULL",
    "two-selects": "SELECT 4; SELECT COUNT(*) FROM orders",
    "delete-then-select": "DELETE FROM orders; SELECT COUNT(*) FROM orders",
    "cte-that-inserts": "WITH t AS (SELECT 9 AS a) INSERT INTO orders (id) SELECT a FROM t",
    "insert-returning": "INSERT INTO orders (id) VALUES (9) RETURNING id",
    "drop-after-select": "SELECT COUNT(*) FROM orders; DROP TABLE orders",
    "create-trigger": "CREATE TRIGGER t AFTER INSERT ON orders BEGIN DELETE FROM customers; END",
    "transaction": "BEGIN; SELECT 4",
    "replace-into": "REPLACE INTO orders (id) VALUES (9)",
}


class TestSandbox:
    """A prediction must never reach the file system: each escape is rejected and nothing is written.

    The gold query counts 4 orders, so a prediction that smuggles a side effect in before or after an
    honest `SELECT COUNT(*)` would score correct if only the last result were compared.
    """

    @pytest.mark.parametrize("pred", list(ESCAPES.values()), ids=list(ESCAPES))
    def test_escape_is_rejected_and_writes_nothing(
        self, pred: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.chdir(tmp_path)
        target = tmp_path / "escaped.db"
        r = judge(pred.format(path=target), "SELECT COUNT(*) FROM orders")
        assert not r.match and r.reason is Reason.INVALID_SQL, r
        assert _files_under(tmp_path) == [], f"{pred!r} wrote {_files_under(tmp_path)}"

    def test_gold_and_context_are_sandboxed_too(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.chdir(tmp_path)
        target = tmp_path / "escaped.db"
        gold = judge("SELECT 1", f"VACUUM INTO '{target}'; SELECT 1")
        assert gold.reason is Reason.GOLD_ERROR, gold
        context = judge("SELECT 1", "SELECT 1", context=f"CREATE TABLE t (a INT); VACUUM INTO '{target}';")
        assert context.reason is Reason.CONTEXT_ERROR, context
        assert _files_under(tmp_path) == []

    @pytest.mark.parametrize(
        "statement",
        [
            "VACUUM INTO '{path}'",
            "ATTACH DATABASE '{path}' AS x",
            "ATTACH '{path}' AS x",
            "attach database 'file:{path}?mode=rwc' as x",
            "SELECT load_extension('{path}')",
            "PRAGMA journal_mode = WAL",
            "PRAGMA writable_schema = ON",
            "PRAGMA user_version = 3",
            "PRAGMA table_info(t)",
            "CREATE TEMP TABLE z (a INT)",
            "CREATE TRIGGER tr AFTER INSERT ON t BEGIN DELETE FROM t; END",
            "CREATE VIRTUAL TABLE v USING fts5(a)",
            "BEGIN",
            "SAVEPOINT s",
            "ANALYZE",
        ],
    )
    @pytest.mark.parametrize("access", ["read", "change"])
    def test_the_connection_itself_denies_escapes(
        self, statement: str, access: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The last line of defence: raw SQLite, no sqlglot in front of it."""
        monkeypatch.chdir(tmp_path)
        template = sandboxed_connection(NOW, "change")
        template.execute("CREATE TABLE t (a INT)")
        template.execute("INSERT INTO t VALUES (1)")
        conn = sandboxed_connection(NOW, access)
        template.backup(conn)  # as the evaluator copies the context database
        try:
            with pytest.raises(sqlite3.DatabaseError, match=r"not authorized|authorization denied|too many attached"):
                conn.execute(statement.format(path=tmp_path / "escaped.db")).fetchall()
        finally:
            conn.close()
            template.close()
        assert _files_under(tmp_path) == []

    def test_read_access_reads_and_change_access_changes_main_only(self) -> None:
        conn = sandboxed_connection(NOW, "change")
        try:
            conn.execute("CREATE TABLE t (a INT)")
            conn.execute("INSERT INTO t VALUES (1), (2)")
            conn.execute("CREATE VIEW v AS SELECT a FROM t WHERE a > 1")
            conn.execute("ALTER TABLE t ADD COLUMN b TEXT")
            conn.execute("CREATE INDEX i ON t (a)")
            conn.execute("UPDATE t SET b = UPPER('x')")
            assert conn.execute("SELECT a, b FROM v JOIN t USING (a)").fetchall() == [(2, "X")]
        finally:
            conn.close()
        reader = sandboxed_connection(NOW, "read")
        try:
            reader.execute("SELECT YEAR(NOW()), LOWER('A'), json_extract('[5]', '$[0]')").fetchall()
            for statement in ["CREATE TABLE u (a INT)", "WITH x AS (SELECT 1) SELECT * FROM x; DELETE FROM u"]:
                with pytest.raises((sqlite3.DatabaseError, sqlite3.ProgrammingError)):
                    reader.execute(statement)
        finally:
            reader.close()

    def test_legitimate_queries_are_still_scored(self) -> None:
        assert judge("SELECT COUNT(*) FROM orders", "SELECT COUNT(id) FROM orders").match
        assert judge(
            "WITH t AS (SELECT customer, amount FROM orders) SELECT customer FROM t WHERE amount > 8",
            "SELECT customer FROM orders WHERE amount > 8",
        ).match
        assert judge("UPDATE orders SET amount = 0 WHERE id = 1", "UPDATE orders SET amount = 0 WHERE id = 1").match

    def test_prediction_may_not_change_data_when_the_gold_only_reads(self) -> None:
        r = judge("DELETE FROM orders WHERE id = 99", "SELECT COUNT(*) FROM orders")
        assert r.reason is Reason.INVALID_SQL and "only reads" in r.detail


class TestDataDefinition:
    """gretel has "data definition" tasks: the gold query creates or alters a table, view or index."""

    def test_view_and_index_are_part_of_the_outcome(self) -> None:
        gold = "CREATE VIEW porto AS SELECT name FROM customers WHERE city = 'Porto'"
        assert judge("CREATE VIEW porto AS SELECT name FROM customers WHERE city = 'Porto'", gold).match
        noop = judge("DELETE FROM customers WHERE 1 = 0", gold)
        assert noop.reason is Reason.MISMATCH, noop
        assert judge("CREATE INDEX idx ON orders (customer)", "CREATE INDEX idx ON orders (customer)").match
        assert (
            judge("DELETE FROM orders WHERE 1 = 0", "CREATE INDEX idx ON orders (customer)").reason is Reason.MISMATCH
        )

    def test_added_column_is_compared(self) -> None:
        gold = "ALTER TABLE customers ADD COLUMN email VARCHAR(50)"
        assert judge("ALTER TABLE customers ADD email VARCHAR(50)", gold).match
        assert judge("ALTER TABLE customers ADD COLUMN mail VARCHAR(50)", gold).reason is Reason.MISMATCH


FUNCTION_CONTEXT = (
    CONTEXT
    + """
CREATE TABLE n (x INT, s VARCHAR(20), d DATETIME);
INSERT INTO n VALUES (1, 'abcdef', '2024-03-10 13:45:30'), (2, 'Banana', '2024-03-11 00:00:00'),
                     (3, NULL, NULL), (4, 'cab', '2024-08-15 09:00:00');
"""
)
# MySQL function -> (gold query using it, the value MySQL returns, written as SQL). NOW is 2024-03-10 12:00:00.
MYSQL_CASES = {
    "CURDATE": ("SELECT CURDATE()", "'2024-03-10'"),
    "CURRENT_DATE": ("SELECT CURRENT_DATE", "'2024-03-10'"),
    "NOW": ("SELECT NOW()", "'2024-03-10 12:00:00'"),
    "CURRENT_TIMESTAMP": ("SELECT CURRENT_TIMESTAMP", "'2024-03-10 12:00:00'"),
    "SYSDATE": ("SELECT SYSDATE()", "'2024-03-10 12:00:00'"),
    "UTC_TIMESTAMP": ("SELECT UTC_TIMESTAMP()", "'2024-03-10 12:00:00'"),
    "DATE_ADD": ("SELECT DATE_ADD('2024-01-31', INTERVAL 1 MONTH)", "'2024-02-29'"),
    "DATE_SUB": ("SELECT DATE_SUB('2024-03-10', INTERVAL 10 DAY)", "'2024-02-29'"),
    "INTERVAL": ("SELECT COUNT(*) FROM n WHERE d > NOW() - INTERVAL 1 DAY", "3"),
    "TIMESTAMPDIFF": ("SELECT TIMESTAMPDIFF(MONTH, '2024-01-31', '2024-03-30')", "1"),
    "DATEDIFF": ("SELECT DATEDIFF('2024-03-10', '2024-03-01')", "9"),
    "EXTRACT": ("SELECT EXTRACT(MONTH FROM d) FROM n WHERE x = 1", "3"),
    "YEAR": ("SELECT x FROM n WHERE YEAR(d) = 2024 AND x > 3", "4"),
    "MONTH": ("SELECT MONTH(d) FROM n WHERE x = 4", "8"),
    "DAY": ("SELECT DAY(d) FROM n WHERE x = 1", "10"),
    "DAYOFMONTH": ("SELECT DAYOFMONTH(d) FROM n WHERE x = 2", "11"),
    "HOUR": ("SELECT HOUR(d) FROM n WHERE x = 1", "13"),
    "MINUTE": ("SELECT MINUTE(d) FROM n WHERE x = 1", "45"),
    "SECOND": ("SELECT SECOND(d) FROM n WHERE x = 1", "30"),
    "QUARTER": ("SELECT QUARTER(d) FROM n WHERE x = 4", "3"),
    "WEEK": ("SELECT WEEK('2024-03-11')", "10"),  # mode 0: weeks start on Sunday
    "WEEKOFYEAR": ("SELECT WEEKOFYEAR('2024-03-11')", "11"),  # ISO week
    "WEEKDAY": ("SELECT WEEKDAY('2024-03-10')", "6"),  # Monday = 0
    "DAYOFWEEK": ("SELECT DAYOFWEEK('2024-03-10')", "1"),  # Sunday = 1
    "DAYOFYEAR": ("SELECT DAYOFYEAR('2024-03-10')", "70"),
    "DAYNAME": ("SELECT DAYNAME(d) FROM n WHERE x = 1", "'Sunday'"),
    "MONTHNAME": ("SELECT MONTHNAME(d) FROM n WHERE x = 4", "'August'"),
    "LAST_DAY": ("SELECT LAST_DAY('2024-02-10')", "'2024-02-29'"),
    "UNIX_TIMESTAMP": ("SELECT UNIX_TIMESTAMP('2024-01-01 00:00:00')", "1704067200"),
    "DATE_FORMAT": ("SELECT DATE_FORMAT(d, '%W %M %Y %H:%i') FROM n WHERE x = 1", "'Sunday March 2024 13:45'"),
    "LEFT": ("SELECT LEFT(s, 2) FROM n WHERE x = 1", "'ab'"),
    "RIGHT": ("SELECT x FROM n WHERE RIGHT(s, 3) = 'ana'", "2"),
    "REGEXP": ("SELECT x FROM n WHERE s REGEXP '^ab'", "1"),
    "RLIKE": ("SELECT x FROM n WHERE s RLIKE 'B$'", "4"),  # case-insensitive, as MySQL's default collation
    "STD": ("SELECT STD(x) FROM n", "1.118034"),
    "STDDEV": ("SELECT STDDEV(x) FROM n", "1.118034"),
    "STDDEV_POP": ("SELECT STDDEV_POP(x) FROM n", "1.118034"),
    "STDDEV_SAMP": ("SELECT STDDEV_SAMP(x) FROM n", "1.290994"),
    "VARIANCE": ("SELECT VARIANCE(x) FROM n", "1.25"),
    "VAR_POP": ("SELECT VAR_POP(x) FROM n", "1.25"),
    "VAR_SAMP": ("SELECT VAR_SAMP(x) FROM n", "1.666667"),
}


def test_every_supported_mysql_function_has_a_gold_query_case() -> None:
    assert set(MYSQL_CASES) == set(MYSQL_FUNCTIONS)


@pytest.mark.parametrize("name", MYSQL_FUNCTIONS)
def test_mysql_function_in_a_gold_query_returns_what_mysql_returns(name: str) -> None:
    gold, expected = MYSQL_CASES[name]
    r = evaluate_sql(f"SELECT {expected}", gold, FUNCTION_CONTEXT, now=NOW)
    assert r.match and r.reason is Reason.OK, (gold, r)
    # and a prediction written with the same function is scored too
    assert evaluate_sql(gold, gold, FUNCTION_CONTEXT, now=NOW).match


def test_left_and_right_with_null_and_negative_lengths() -> None:
    assert judge("SELECT NULL, ''", "SELECT LEFT(NULL, 2), RIGHT('abc', -1)").match


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
