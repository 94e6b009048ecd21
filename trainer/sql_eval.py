"""Execution match for text-to-SQL: does the predicted query return what the gold query returns?

Decisions:
- The gretel rows are MySQL-flavoured (`sql_context` is CREATE TABLE + INSERT statements). We
  run them in an in-memory SQLite, not MySQL: no server, no network, millisecond start. Every
  statement is parsed by sqlglot as MySQL, a few MySQL-only constructs are rewritten in the
  syntax tree, and the result is generated as SQLite:
  - `DATE_SUB/DATE_ADD(x, INTERVAL n UNIT)` and `x ± INTERVAL n UNIT` become `MYSQL_DATE_ADD(x, ±n, 'UNIT')`,
  - `CURDATE()/CURRENT_DATE`, `NOW()/CURRENT_TIMESTAMP/UTC_TIMESTAMP()` become calls to registered
    functions that read one frozen clock (the gold and the predicted query see the same "now"),
  - `EXTRACT(YEAR FROM x)` becomes `YEAR(x)`; `TIMESTAMPDIFF(UNIT, a, b)` a registered function,
  - `ENUM(...)`/`SET(...)` column types become TEXT.
  YEAR(), MONTH(), DAYNAME(), LEFT(), REGEXP, STDDEV … are Python functions registered on the
  connection (SQLite has none of them).
- A query runs on a fresh copy of the context database, so a DELETE/UPDATE/INSERT gold query
  (gretel has "data manipulation" tasks) is compared by the table contents it leaves behind.
- Results are compared as multisets of rows (numbers rounded to 6 decimals, column names
  ignored); in order when the gold query has a top-level ORDER BY.
- A time budget per statement list (sqlite3 progress handler) stops runaway queries (a
  recursive CTE without end, a huge cross join): reason `timeout`. A row cap stops result sets
  that would exhaust memory: reason `too_large`. Nothing here raises: every failure is a
  result with a reason.

What this module deliberately does not do: emulate every MySQL function or MySQL's type
coercions (string/number comparison, integer division). Queries that depend on those are judged
by SQLite's semantics, the same way for the gold and the predicted query.

    from trainer.sql_eval import execution_match, evaluate_sql
    execution_match("SELECT COUNT(*) FROM t", "SELECT COUNT(id) FROM t", "CREATE TABLE t (id INT); INSERT INTO t VALUES (1);")
"""

from __future__ import annotations

import calendar
import math
import re
import sqlite3
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from enum import StrEnum
from typing import Any

import sqlglot
from sqlglot import exp

__all__ = ["Reason", "SqlEvalResult", "evaluate_sql", "execution_match", "to_sqlite"]

DEFAULT_MAX_ROWS = 100_000
_PROGRESS_EVERY_N_OPS = 2_000
_MAX_VALUE_BYTES = 10_000_000


class Reason(StrEnum):
    OK = "ok"
    MISMATCH = "mismatch"
    INVALID_SQL = "invalid_sql"
    TIMEOUT = "timeout"
    TOO_LARGE = "too_large"
    CONTEXT_ERROR = "context_error"
    GOLD_ERROR = "gold_error"


@dataclass(frozen=True)
class SqlEvalResult:
    """The verdict on one prediction; `detail` is a short human-readable explanation."""

    match: bool
    reason: Reason
    detail: str = ""

    def __bool__(self) -> bool:
        return self.match


class _Budget(Exception):
    """Raised internally when a query exceeds its time or row budget."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


# --------------------------------------------------------------------------------------
# MySQL → SQLite rewriting


_EXTRACT_UNITS = {"YEAR", "MONTH", "DAY", "HOUR", "MINUTE", "SECOND", "QUARTER", "WEEK"}


def _unit_name(node: exp.Expression | None, default: str = "DAY") -> str:
    if node is None:
        return default
    return node.name.upper() if node.name else node.sql().upper()


def _date_add_call(this: exp.Expression, amount: exp.Expression, unit: str, sign: int) -> exp.Expression:
    this, amount = _rewritten(this), _rewritten(amount)
    if sign < 0:
        amount = exp.Neg(this=exp.Paren(this=amount))
    return exp.Anonymous(this="MYSQL_DATE_ADD", expressions=[this, amount, exp.Literal.string(unit)])


def _rewritten(node: exp.Expression) -> exp.Expression:
    """sqlglot's transform does not revisit the children we move into a replacement node."""
    return node.transform(_rewrite)


def _rewrite(node: exp.Expression) -> exp.Expression:
    """Replace MySQL-only nodes by calls to the functions registered in `_register_functions`."""
    if isinstance(node, exp.DateAdd | exp.DateSub):
        sign = -1 if isinstance(node, exp.DateSub) else 1
        return _date_add_call(node.this, node.expression, _unit_name(node.args.get("unit")), sign)
    if isinstance(node, exp.Add | exp.Sub) and isinstance(node.expression, exp.Interval):
        interval = node.expression
        sign = -1 if isinstance(node, exp.Sub) else 1
        return _date_add_call(node.this, interval.this, _unit_name(interval.args.get("unit")), sign)
    if isinstance(node, exp.CurrentDate):
        return exp.Anonymous(this="CURDATE", expressions=[])
    if isinstance(node, exp.CurrentTimestamp | exp.UtcTimestamp) or (
        isinstance(node, exp.Anonymous) and str(node.this).upper() in {"NOW", "SYSDATE", "LOCALTIME"}
    ):
        return exp.Anonymous(this="NOW", expressions=[])
    if isinstance(node, exp.Extract):
        unit = _unit_name(node.this)
        if unit in _EXTRACT_UNITS:
            return exp.Anonymous(this=unit, expressions=[_rewritten(node.expression)])
    if isinstance(node, exp.TimestampDiff):
        unit = _unit_name(node.args.get("unit"))
        # sqlglot stores TIMESTAMPDIFF(unit, start, end) as this=end, expression=start
        return exp.Anonymous(
            this="MYSQL_TIMESTAMPDIFF",
            expressions=[exp.Literal.string(unit), _rewritten(node.expression), _rewritten(node.this)],
        )
    if isinstance(node, exp.DataType) and node.this in {exp.DataType.Type.ENUM, exp.DataType.Type.SET}:
        return exp.DataType.build("TEXT")
    return node


def to_sqlite(sql: str) -> list[str]:
    """Transpile MySQL-flavoured SQL (one or more statements) to SQLite statements.

    Raises sqlglot.errors.ParseError (or another sqlglot error) when the SQL does not parse.
    """
    statements = [s for s in sqlglot.parse(sql, read="mysql") if s is not None]
    return [s.transform(_rewrite).sql(dialect="sqlite") for s in statements]


def _has_top_level_order_by(sql: str) -> bool:
    """True when the last statement of `sql` sorts its result (ORDER BY on the outermost query)."""
    try:
        statements = [s for s in sqlglot.parse(sql, read="mysql") if s is not None]
    except Exception:
        return False
    return bool(statements) and statements[-1].args.get("order") is not None


# --------------------------------------------------------------------------------------
# Functions SQLite lacks, registered per connection


def _parse_temporal(value: Any) -> datetime | None:
    """MySQL DATE/DATETIME text (or a date object) → datetime; None when it is not a date."""
    if value is None:
        return None
    if isinstance(value, datetime):
        return value
    if isinstance(value, date):
        return datetime(value.year, value.month, value.day)
    text = str(value).strip().replace("T", " ")
    for fmt in ("%Y-%m-%d %H:%M:%S.%f", "%Y-%m-%d %H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%d", "%Y%m%d"):
        try:
            return datetime.strptime(text, fmt)
        except ValueError:
            continue
    return None


def _has_time(value: Any) -> bool:
    return isinstance(value, datetime) or (isinstance(value, str) and len(value.strip()) > 10)


def _format(moment: datetime, with_time: bool) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%S") if with_time else moment.strftime("%Y-%m-%d")


def _add_months(moment: datetime, months: int) -> datetime:
    """MySQL semantics: the day is clamped to the end of the target month (Jan 31 + 1 month = Feb 28/29)."""
    total = moment.year * 12 + (moment.month - 1) + months
    year, month = divmod(total, 12)
    if not 1 <= year <= 9999:
        raise OverflowError
    day = min(moment.day, calendar.monthrange(year, month + 1)[1])
    return moment.replace(year=year, month=month + 1, day=day)


_FIXED_UNITS = {
    "MICROSECOND": timedelta(microseconds=1),
    "SECOND": timedelta(seconds=1),
    "MINUTE": timedelta(minutes=1),
    "HOUR": timedelta(hours=1),
    "DAY": timedelta(days=1),
    "WEEK": timedelta(weeks=1),
}
_MONTH_UNITS = {"MONTH": 1, "QUARTER": 3, "YEAR": 12}


def _mysql_date_add(value: Any, amount: Any, unit: str) -> str | None:
    moment = _parse_temporal(value)
    if moment is None or amount is None:
        return None
    try:
        number = float(amount)
        unit = str(unit).upper()
        if unit in _MONTH_UNITS:
            result = _add_months(moment, int(number) * _MONTH_UNITS[unit])
        elif unit in _FIXED_UNITS:
            result = moment + number * _FIXED_UNITS[unit]
        else:
            return None
    except (ValueError, OverflowError, TypeError):
        return None
    with_time = _has_time(value) or unit not in {"DAY", "WEEK", *_MONTH_UNITS}
    return _format(result, with_time)


def _mysql_timestampdiff(unit: str, start: Any, end: Any) -> int | None:
    a, b = _parse_temporal(start), _parse_temporal(end)
    if a is None or b is None:
        return None
    unit = str(unit).upper()
    if unit in _MONTH_UNITS:
        months = (b.year - a.year) * 12 + (b.month - a.month)
        # a partial month does not count (MySQL truncates toward zero)
        if months > 0 and (b.day, b.time()) < (a.day, a.time()):
            months -= 1
        elif months < 0 and (b.day, b.time()) > (a.day, a.time()):
            months += 1
        return int(months / _MONTH_UNITS[unit])
    if unit in _FIXED_UNITS:
        return int((b - a) / _FIXED_UNITS[unit])
    return None


def _part(getter: Callable[[datetime], Any]) -> Callable[[Any], Any]:
    def fn(value: Any) -> Any:
        moment = _parse_temporal(value)
        return None if moment is None else getter(moment)

    return fn


def _regexp(pattern: Any, text: Any) -> int | None:
    if pattern is None or text is None:
        return None
    try:
        return int(re.search(str(pattern), str(text), flags=re.IGNORECASE) is not None)
    except re.error:
        return None


def _left(text: Any, n: Any) -> str | None:
    return None if text is None or n is None else str(text)[: max(int(n), 0)]


def _right(text: Any, n: Any) -> str | None:
    if text is None or n is None:
        return None
    n = max(int(n), 0)
    return str(text)[-n:] if n else ""


class _Variance:
    """Population variance (MySQL VARIANCE/VAR_POP); `_StdDev` takes its square root."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def step(self, value: Any) -> None:
        if value is not None:
            self.values.append(float(value))

    def finalize(self) -> float | None:
        if not self.values:
            return None
        mean = sum(self.values) / len(self.values)
        return sum((v - mean) ** 2 for v in self.values) / len(self.values)


class _StdDev(_Variance):
    def finalize(self) -> float | None:
        var = super().finalize()
        return None if var is None else math.sqrt(var)


def _register_functions(conn: sqlite3.Connection, now: datetime) -> None:
    today = now.strftime("%Y-%m-%d")
    stamp = now.strftime("%Y-%m-%d %H:%M:%S")
    scalar: dict[str, tuple[int, Callable[..., Any]]] = {
        "NOW": (0, lambda: stamp),
        "CURDATE": (0, lambda: today),
        "MYSQL_DATE_ADD": (3, _mysql_date_add),
        "MYSQL_TIMESTAMPDIFF": (3, _mysql_timestampdiff),
        "YEAR": (1, _part(lambda m: m.year)),
        "MONTH": (1, _part(lambda m: m.month)),
        "DAY": (1, _part(lambda m: m.day)),
        "DAYOFMONTH": (1, _part(lambda m: m.day)),
        "DAY_OF_MONTH": (1, _part(lambda m: m.day)),
        "HOUR": (1, _part(lambda m: m.hour)),
        "MINUTE": (1, _part(lambda m: m.minute)),
        "SECOND": (1, _part(lambda m: m.second)),
        "QUARTER": (1, _part(lambda m: (m.month - 1) // 3 + 1)),
        "WEEK": (1, _part(lambda m: int(m.strftime("%U")))),
        "DAYOFWEEK": (1, _part(lambda m: m.isoweekday() % 7 + 1)),
        "DAY_OF_WEEK": (1, _part(lambda m: m.isoweekday() % 7 + 1)),
        "DAYOFYEAR": (1, _part(lambda m: m.timetuple().tm_yday)),
        "DAYNAME": (1, _part(lambda m: m.strftime("%A"))),
        "MONTHNAME": (1, _part(lambda m: m.strftime("%B"))),
        "LAST_DAY": (1, _part(lambda m: _format(m.replace(day=calendar.monthrange(m.year, m.month)[1]), False))),
        "UNIX_TIMESTAMP": (1, _part(lambda m: int(m.timestamp()))),
        "LEFT": (2, _left),
        "RIGHT": (2, _right),
        "REGEXP": (2, _regexp),
    }
    for name, (n_args, fn) in scalar.items():
        conn.create_function(name, n_args, fn, deterministic=name not in {"NOW", "CURDATE"})
    aggregates: dict[str, Any] = {
        "VARIANCE_POP": _Variance,
        "VARIANCE": _Variance,
        "STDDEV_POP": _StdDev,
        "STDDEV": _StdDev,
    }
    for name, cls in aggregates.items():
        conn.create_aggregate(name, 1, cls)


# --------------------------------------------------------------------------------------
# Running statements under a budget


def _connect(now: datetime) -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, _MAX_VALUE_BYTES)
    _register_functions(conn, now)
    return conn


def _run(
    conn: sqlite3.Connection, statements: Sequence[str], timeout_s: float, max_rows: int
) -> list[tuple[Any, ...]] | None:
    """Execute `statements`; return the rows of the last one that produced rows, else None.

    Raises _Budget on timeout/too many rows and sqlite3.Error on invalid SQL.
    """
    deadline = time.monotonic() + timeout_s
    timed_out = False

    def check() -> int:
        nonlocal timed_out
        timed_out = time.monotonic() > deadline
        return 1 if timed_out else 0

    conn.set_progress_handler(check, _PROGRESS_EVERY_N_OPS)
    rows: list[tuple[Any, ...]] | None = None
    try:
        for statement in statements:
            cursor = conn.execute(statement)
            if cursor.description is None:
                continue
            rows = []
            while batch := cursor.fetchmany(1_000):
                rows.extend(batch)
                if len(rows) > max_rows:
                    raise _Budget(Reason.TOO_LARGE, f"more than {max_rows} rows")
    except sqlite3.OperationalError as exc:
        if timed_out:
            raise _Budget(Reason.TIMEOUT, f"stopped after {timeout_s:g} s") from exc
        raise
    finally:
        conn.set_progress_handler(None, 0)
    return rows


def _normalise_value(value: Any) -> Any:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int | float):
        number = float(value)
        return round(number, 6) if math.isfinite(number) else number
    return value


def _normalise(rows: Sequence[Sequence[Any]]) -> list[tuple[Any, ...]]:
    return [tuple(_normalise_value(v) for v in row) for row in rows]


def _table_state(conn: sqlite3.Connection) -> dict[str, Counter[tuple[Any, ...]]]:
    names = [
        r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")
    ]
    return {name: Counter(_normalise(conn.execute(f'SELECT * FROM "{name}"').fetchall())) for name in sorted(names)}


@dataclass
class _Outcome:
    rows: list[tuple[Any, ...]] | None = None
    state: dict[str, Counter[tuple[Any, ...]]] = field(default_factory=dict)


def _execute_on_copy(
    template: sqlite3.Connection, statements: Sequence[str], now: datetime, timeout_s: float, max_rows: int
) -> _Outcome:
    conn = _connect(now)
    try:
        template.backup(conn)
        rows = _run(conn, statements, timeout_s, max_rows)
        if rows is not None:
            return _Outcome(rows=_normalise(rows))
        return _Outcome(state=_table_state(conn))
    finally:
        conn.close()


def _same(pred: _Outcome, gold: _Outcome, ordered: bool) -> bool:
    if gold.rows is None or pred.rows is None:
        return gold.rows is None and pred.rows is None and pred.state == gold.state
    if ordered:
        return pred.rows == gold.rows
    return Counter(pred.rows) == Counter(gold.rows)


def evaluate_sql(
    pred_sql: str,
    gold_sql: str,
    context_sql: str,
    timeout_s: float = 2.0,
    *,
    now: datetime | None = None,
    max_rows: int = DEFAULT_MAX_ROWS,
) -> SqlEvalResult:
    """Compare the predicted and gold queries by executing both against `context_sql`.

    `timeout_s` is the budget for building the context and, separately, for each query.
    `now` freezes NOW()/CURDATE() (default: the current time, read once, so both queries
    agree). Never raises.
    """
    moment = (now or datetime.now()).replace(microsecond=0)
    try:
        context = to_sqlite(context_sql)
    except Exception as exc:
        return SqlEvalResult(False, Reason.CONTEXT_ERROR, f"context does not parse: {exc}")
    template = _connect(moment)
    try:
        try:
            _run(template, context, timeout_s, max_rows)
        except _Budget as exc:
            return SqlEvalResult(False, Reason.CONTEXT_ERROR, f"context: {exc}")
        except (sqlite3.Error, ValueError, OverflowError) as exc:
            return SqlEvalResult(False, Reason.CONTEXT_ERROR, f"context fails to run: {exc}")
        try:
            gold = _execute_on_copy(template, to_sqlite(gold_sql), moment, timeout_s, max_rows)
        except Exception as exc:
            return SqlEvalResult(False, Reason.GOLD_ERROR, f"gold query fails: {exc}")
        try:
            pred_statements = to_sqlite(pred_sql)
        except Exception as exc:
            return SqlEvalResult(False, Reason.INVALID_SQL, f"does not parse: {exc}")
        if not pred_statements:
            return SqlEvalResult(False, Reason.INVALID_SQL, "empty query")
        try:
            pred = _execute_on_copy(template, pred_statements, moment, timeout_s, max_rows)
        except _Budget as exc:
            return SqlEvalResult(False, exc.reason, str(exc))
        except Exception as exc:
            return SqlEvalResult(False, Reason.INVALID_SQL, f"fails to run: {exc}")
    finally:
        template.close()
    ordered = _has_top_level_order_by(gold_sql)
    if _same(pred, gold, ordered):
        return SqlEvalResult(True, Reason.OK, "same rows in the same order" if ordered else "same rows")
    return SqlEvalResult(False, Reason.MISMATCH, "different rows" + (" or order" if ordered else ""))


def execution_match(pred_sql: str, gold_sql: str, context_sql: str, timeout_s: float = 2.0) -> bool:
    """True when the predicted query returns the gold query's result (see `evaluate_sql`)."""
    return evaluate_sql(pred_sql, gold_sql, context_sql, timeout_s).match
