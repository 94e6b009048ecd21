"""Execution match for text-to-SQL: does the predicted query return what the gold query returns?

    from trainer.sql_eval import execution_match, evaluate_sql
    execution_match("SELECT COUNT(*) FROM t", "SELECT COUNT(id) FROM t", "CREATE TABLE t (id INT); INSERT INTO t VALUES (1);")

Decisions (the rewrites, the sandbox's rules and their sources: docs/trainer.md#text-to-sql-judged-by-execution):
- The MySQL-flavoured gretel rows run in an in-memory SQLite: sqlglot parses MySQL, rewrites MySQL-only
  constructs, generates SQLite; missing MySQL functions are registered Python functions (`MYSQL_FUNCTIONS`).
- Each connection is a sandbox (no ATTACH, no extensions, an authorizer that denies by default); prediction
  and gold are ONE statement each, unparsed statements are rejected, never executed.
- Each query runs on a fresh copy of the context; results compare as multisets of rows (ordered when the gold
  query has ORDER BY), or by the tables a data-changing query leaves.
- A time budget and a row cap; nothing raises, every failure is a result with a reason.
Not emulated: every MySQL function or MySQL's type coercions (SQLite's semantics judge both queries alike).
"""

from __future__ import annotations

import calendar
import functools
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

__all__ = [
    "MYSQL_FUNCTIONS",
    "Reason",
    "SqlEvalResult",
    "evaluate_sql",
    "execution_match",
    "sandboxed_connection",
    "to_sqlite",
]

# Every MySQL function (or construct) the evaluator supports beyond what sqlglot and SQLite do alone;
# tests/trainer/test_sql_eval.py runs each through a gold query.
MYSQL_FUNCTIONS = (
    "CURDATE",
    "CURRENT_DATE",
    "NOW",
    "CURRENT_TIMESTAMP",
    "SYSDATE",
    "UTC_TIMESTAMP",
    "DATE_ADD",
    "DATE_SUB",
    "INTERVAL",
    "TIMESTAMPDIFF",
    "DATEDIFF",
    "EXTRACT",
    "YEAR",
    "MONTH",
    "DAY",
    "DAYOFMONTH",
    "HOUR",
    "MINUTE",
    "SECOND",
    "QUARTER",
    "WEEK",
    "WEEKOFYEAR",
    "WEEKDAY",
    "DAYOFWEEK",
    "DAYOFYEAR",
    "DAYNAME",
    "MONTHNAME",
    "LAST_DAY",
    "UNIX_TIMESTAMP",
    "DATE_FORMAT",
    "LEFT",
    "RIGHT",
    "REGEXP",
    "RLIKE",
    "STD",
    "STDDEV",
    "STDDEV_POP",
    "STDDEV_SAMP",
    "VARIANCE",
    "VAR_POP",
    "VAR_SAMP",
)
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
    if isinstance(node, exp.Left | exp.Right):
        name = "MYSQL_LEFT" if isinstance(node, exp.Left) else "MYSQL_RIGHT"
        return exp.Anonymous(this=name, expressions=[_rewritten(node.this), _rewritten(node.expression)])
    if isinstance(node, exp.TimeToStr):
        # sqlglot has already turned MySQL's format (%M, %W, %i ...) into strftime's (%B, %A, %M ...)
        return exp.Anonymous(
            this="MYSQL_DATE_FORMAT", expressions=[_rewritten(node.this), _rewritten(node.args["format"])]
        )
    if isinstance(node, exp.DataType) and node.this in {exp.DataType.Type.ENUM, exp.DataType.Type.SET}:
        return exp.DataType.build("TEXT")
    return node


class _Access(StrEnum):
    """What a statement may do to its in-memory database (see the module docstring)."""

    READ = "read"
    CHANGE = "change"


# Statements the evaluator runs: a query reads; these change the in-memory `main` database.
_CHANGE_STATEMENTS = (exp.Insert, exp.Update, exp.Delete, exp.Create, exp.Drop, exp.Alter)


class UnsupportedStatement(ValueError):
    """A statement the evaluator refuses to run (unparsed Command, PRAGMA, ATTACH, more than one, ...)."""


def _parse(sql: str) -> list[exp.Expr]:
    statements = [s for s in sqlglot.parse(sql, read="mysql") if s is not None]
    for statement in statements:
        if isinstance(statement, exp.Command):
            raise UnsupportedStatement(f"not a statement the evaluator runs: {statement.sql()[:60]!r}")
        if not isinstance(statement, (exp.Query, *_CHANGE_STATEMENTS)):
            raise UnsupportedStatement(f"{type(statement).__name__} statements are not evaluated")
    return statements


def _access(statement: exp.Expr) -> _Access:
    return _Access.READ if isinstance(statement, exp.Query) else _Access.CHANGE


def _to_sqlite_text(statement: exp.Expr) -> str:
    return statement.transform(_rewrite).sql(dialect="sqlite")


def to_sqlite(sql: str) -> list[str]:
    """Transpile MySQL-flavoured SQL (one or more statements) to SQLite statements.

    Raises sqlglot.errors.ParseError (or another sqlglot error) when the SQL does not parse, and
    UnsupportedStatement for a statement the evaluator never runs (see the module docstring).
    """
    return [_to_sqlite_text(s) for s in _parse(sql)]


def _single_statement(sql: str) -> tuple[str, _Access]:
    """The one statement of a gold or predicted query, as SQLite, and what it may do."""
    statements = _parse(sql)
    if len(statements) != 1:
        raise UnsupportedStatement(f"expected exactly one statement, got {len(statements)}")
    return _to_sqlite_text(statements[0]), _access(statements[0])


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


def _date_format(value: Any, fmt: Any) -> str | None:
    moment = _parse_temporal(value)
    return None if moment is None or fmt is None else moment.strftime(str(fmt))


def _unix_timestamp(moment: datetime) -> int:
    """Seconds since the epoch, reading the date as UTC (the evaluator's session time zone)."""
    return calendar.timegm(moment.timetuple())


def _left(text: Any, n: Any) -> str | None:
    return None if text is None or n is None else str(text)[: max(int(n), 0)]


def _right(text: Any, n: Any) -> str | None:
    if text is None or n is None:
        return None
    n = max(int(n), 0)
    return str(text)[-n:] if n else ""


class _Variance:
    """Population variance (MySQL VARIANCE/VAR_POP); subclasses give the sample variance and square roots."""

    ddof = 0  # delta degrees of freedom: 0 population, 1 sample

    def __init__(self) -> None:
        self.values: list[float] = []

    def step(self, value: Any) -> None:
        if value is not None:
            self.values.append(float(value))

    def finalize(self) -> float | None:
        if len(self.values) <= self.ddof:
            return None
        mean = sum(self.values) / len(self.values)
        return sum((v - mean) ** 2 for v in self.values) / (len(self.values) - self.ddof)


class _SampleVariance(_Variance):
    ddof = 1


class _StdDev(_Variance):
    def finalize(self) -> float | None:
        var = super().finalize()
        return None if var is None else math.sqrt(var)


class _SampleStdDev(_StdDev):
    ddof = 1


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
        "DAY_OF_YEAR": (1, _part(lambda m: m.timetuple().tm_yday)),
        "WEEKDAY": (1, _part(lambda m: m.weekday())),
        "WEEK_OF_YEAR": (1, _part(lambda m: m.isocalendar()[1])),
        "DAYNAME": (1, _part(lambda m: m.strftime("%A"))),
        "LAST_DAY": (1, _part(lambda m: _format(m.replace(day=calendar.monthrange(m.year, m.month)[1]), False))),
        "UNIX_TIMESTAMP": (1, _part(_unix_timestamp)),
        "MYSQL_DATE_FORMAT": (2, _date_format),
        "MYSQL_LEFT": (2, _left),
        "MYSQL_RIGHT": (2, _right),
        "REGEXP": (2, _regexp),
    }
    for name, (n_args, fn) in scalar.items():
        conn.create_function(name, n_args, fn, deterministic=name not in {"NOW", "CURDATE"})
    # the names sqlglot generates for SQLite: MySQL VARIANCE/VAR_POP -> VARIANCE_POP, VAR_SAMP -> VARIANCE,
    # STD/STDDEV/STDDEV_POP -> STDDEV_POP, STDDEV_SAMP -> STDDEV_SAMP
    aggregates: dict[str, Any] = {
        "VARIANCE_POP": _Variance,
        "VARIANCE": _SampleVariance,
        "STDDEV_POP": _StdDev,
        "STDDEV_SAMP": _SampleStdDev,
    }
    for name, cls in aggregates.items():
        conn.create_aggregate(name, 1, cls)


# --------------------------------------------------------------------------------------
# The sandbox: one in-memory database, no files, a deny-by-default authorizer

# PRAGMA function_list flags (https://sqlite.org/c3ref/c_deterministic.html)
_SQLITE_DETERMINISTIC = 0x000000800
_SQLITE_DIRECTONLY = 0x000080000
_SQLITE_INNOCUOUS = 0x000200000

_READ_ACTIONS = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE})
# Changes to the in-memory `main` database; ALTER TABLE is checked apart (its database name is the first argument).
_CHANGE_ACTIONS = frozenset(
    {
        sqlite3.SQLITE_INSERT,
        sqlite3.SQLITE_UPDATE,
        sqlite3.SQLITE_DELETE,
        sqlite3.SQLITE_CREATE_TABLE,
        sqlite3.SQLITE_CREATE_INDEX,
        sqlite3.SQLITE_CREATE_VIEW,
        sqlite3.SQLITE_DROP_TABLE,
        sqlite3.SQLITE_DROP_INDEX,
        sqlite3.SQLITE_DROP_VIEW,
        sqlite3.SQLITE_REINDEX,  # CREATE INDEX fills the new index through it
    }
)


@functools.cache
def _allowed_functions() -> frozenset[str]:
    """Lower-cased names of the functions a query may call: SQLite's innocuous or deterministic built-ins
    (never the direct-only ones such as load_extension and fts3_tokenizer) and every function registered here."""
    probe = sqlite3.connect(":memory:")
    try:
        _register_functions(probe, datetime(2000, 1, 1))
        rows = probe.execute("PRAGMA function_list").fetchall()
    finally:
        probe.close()
    allowed = set()
    for name, builtin, _type, _encoding, _n_args, flags in rows:
        safe = flags & (_SQLITE_INNOCUOUS | _SQLITE_DETERMINISTIC) and not flags & _SQLITE_DIRECTONLY
        if not builtin or safe:
            allowed.add(str(name).lower())
    return frozenset(allowed)


def _authorizer(access: _Access) -> Callable[[int, str | None, str | None, str | None, str | None], int]:
    allowed_functions = _allowed_functions()

    def authorize(action: int, arg1: str | None, arg2: str | None, database: str | None, _trigger: str | None) -> int:
        if action in _READ_ACTIONS:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_FUNCTION:
            return sqlite3.SQLITE_OK if (arg2 or "").lower() in allowed_functions else sqlite3.SQLITE_DENY
        if access is _Access.CHANGE:
            if action == sqlite3.SQLITE_ALTER_TABLE:
                return sqlite3.SQLITE_OK if arg1 == "main" else sqlite3.SQLITE_DENY
            if action in _CHANGE_ACTIONS and database == "main":
                return sqlite3.SQLITE_OK
        return sqlite3.SQLITE_DENY

    return authorize


def sandboxed_connection(now: datetime | None = None, access: str = "read") -> sqlite3.Connection:
    """An in-memory SQLite connection that cannot reach the file system, other databases or extensions.

    `access` is "read" (queries only) or "change" (also data and schema changes of the in-memory `main`
    database). The MySQL functions of this module are registered, reading `now` as the current time.
    """
    conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, _MAX_VALUE_BYTES)
    conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)  # no ATTACH, so no VACUUM INTO either (it attaches its target)
    conn.execute("PRAGMA temp_store = MEMORY")  # sorts and temporary b-trees never spill into files
    _register_functions(conn, (now or datetime.now()).replace(microsecond=0))
    _set_access(conn, _Access(access))
    return conn


def _set_access(conn: sqlite3.Connection, access: _Access) -> None:
    conn.set_authorizer(_authorizer(access))


# --------------------------------------------------------------------------------------
# Running statements under a budget


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


def _database_state(conn: sqlite3.Connection) -> dict[tuple[str, str], Any]:
    """What a data-changing query leaves behind: each table's columns and rows, each view's columns, each index."""
    _set_access(conn, _Access.READ)
    objects = conn.execute(
        "SELECT type, name, tbl_name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%' ORDER BY type, name"
    ).fetchall()
    state: dict[tuple[str, str], Any] = {}
    for kind, name, table in objects:
        if kind == "index":
            state[(kind, name)] = table
            continue
        if kind not in {"table", "view"}:
            continue
        cursor = conn.execute(f'SELECT * FROM "{name}"')
        columns = tuple(column[0] for column in cursor.description)
        state[(kind, name)] = (columns, Counter(_normalise(cursor.fetchall())) if kind == "table" else None)
    return state


@dataclass
class _Outcome:
    rows: list[tuple[Any, ...]] | None = None
    state: dict[tuple[str, str], Any] = field(default_factory=dict)


def _execute_on_copy(
    template: sqlite3.Connection, statement: str, access: _Access, now: datetime, timeout_s: float, max_rows: int
) -> _Outcome:
    conn = sandboxed_connection(now, access)
    try:
        template.backup(conn)
        rows = _run(conn, [statement], timeout_s, max_rows)
        if rows is not None:
            return _Outcome(rows=_normalise(rows))
        return _Outcome(state=_database_state(conn))
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
    try:
        gold_statement, gold_access = _single_statement(gold_sql)
    except Exception as exc:
        return SqlEvalResult(False, Reason.GOLD_ERROR, f"gold query is not evaluated: {exc}")
    try:
        pred_statement, pred_access = _single_statement(pred_sql)
    except UnsupportedStatement as exc:
        return SqlEvalResult(False, Reason.INVALID_SQL, str(exc))
    except Exception as exc:
        return SqlEvalResult(False, Reason.INVALID_SQL, f"does not parse: {exc}")
    if pred_access is _Access.CHANGE and gold_access is _Access.READ:
        return SqlEvalResult(
            False, Reason.INVALID_SQL, "the gold query only reads; a query that changes data is not run"
        )
    template = sandboxed_connection(moment, _Access.CHANGE)
    try:
        try:
            _run(template, context, timeout_s, max_rows)
        except _Budget as exc:
            return SqlEvalResult(False, Reason.CONTEXT_ERROR, f"context: {exc}")
        except (sqlite3.Error, ValueError, OverflowError) as exc:
            return SqlEvalResult(False, Reason.CONTEXT_ERROR, f"context fails to run: {exc}")
        try:
            gold = _execute_on_copy(template, gold_statement, gold_access, moment, timeout_s, max_rows)
        except Exception as exc:
            return SqlEvalResult(False, Reason.GOLD_ERROR, f"gold query fails: {exc}")
        try:
            # the prediction may do what the gold query does, never more
            pred = _execute_on_copy(template, pred_statement, gold_access, moment, timeout_s, max_rows)
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
