"""The expressions of user score and mask functions: a small typed DAG, its NumPy evaluation and
its symbolic derivative.

A `Node` is one operation on values of one of three kinds: ``float`` (the score and what is
computed from it; float32 on the GPU, float64 in the reference), ``int`` (the indices and what is
computed from them; 64-bit, wrapping like NumPy's int64) and ``bool``. `Graph` builds nodes,
interned (the same operation on the same operands is one node), with the typing rules of
docs/contract.md ("User-defined score and mask functions") and a few exact simplifications, and
refuses what the rules do not allow with a TypeError that names the operation.
"""

from __future__ import annotations

import numpy as np

FLOAT, INT, BOOL = "float", "int", "bool"
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# Operators as the user writes them, for error messages.
SYMBOLS = {
    "add": "+", "sub": "-", "mul": "*", "div": "/", "floordiv": "//", "mod": "%", "pow": "**", "neg": "unary -",
    "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=", "and": "&", "or": "|", "xor": "^",
    "not": "~", "min": "cuflash.minimum", "max": "cuflash.maximum", "abs": "abs", "exp": "cuflash.exp",
    "log": "cuflash.log", "tanh": "cuflash.tanh", "sqrt": "cuflash.sqrt", "floor": "cuflash.floor",
    "where": "cuflash.where",
}
FLOAT_FUNCTIONS = ("exp", "log", "tanh", "sqrt")
COMPARISONS = ("lt", "le", "gt", "ge", "eq", "ne")
LOGICAL = ("and", "or", "xor")


class Node:
    """One operation: ``op`` on ``args`` (nodes) giving a value of ``kind``; ``attr`` holds a
    constant's value, an index's position, a power's exponent or a load's array slot. Nodes are
    made by `Graph.node` only and compared by identity."""

    __slots__ = ("op", "kind", "args", "attr")

    def __init__(self, op: str, kind: str, args: tuple, attr):
        self.op, self.kind, self.args, self.attr = op, kind, args, attr

    def __repr__(self):
        return f"Node({self.op}, {self.kind}, {self.attr!r})"

    @property
    def is_const(self) -> bool:
        return self.op == "const"


def _const_key(value):
    # 1, 1.0 and True are different constants, and -0.0 differs from 0.0.
    return (type(value).__name__, value.hex() if isinstance(value, float) else value)


class Graph:
    """Builds interned nodes. Every operation goes through the typed builders below."""

    def __init__(self):
        self._table = {}

    def node(self, op, kind, args=(), attr=None) -> Node:
        key = (op, kind, tuple(id(a) for a in args), _const_key(attr) if op == "const" else attr)
        found = self._table.get(key)
        if found is None:
            found = self._table[key] = Node(op, kind, tuple(args), attr)
        return found

    # Leaves ------------------------------------------------------------------------------

    def const(self, value) -> Node:
        if isinstance(value, (bool, np.bool_)):
            return self.node("const", BOOL, attr=bool(value))
        if isinstance(value, (int, np.integer)):
            value = int(value)
            if not INT64_MIN <= value <= INT64_MAX:
                raise TypeError(f"the integer constant {value} does not fit in int64")
            return self.node("const", INT, attr=value)
        return self.node("const", FLOAT, attr=float(value))

    def score(self) -> Node:
        return self.node("score", FLOAT)

    def index(self, position) -> Node:
        """Batch index ``position`` (0, 1, ...) or ``"q"`` / ``"kv"``."""
        return self.node("index", INT, attr=position)

    def load(self, slot: int, kind: str, index: tuple) -> Node:
        for i, x in enumerate(index):
            if x.kind != INT:
                raise TypeError(f"captured array index {i} is a {x.kind} expression; indices must be integers")
        return self.node("load", kind, index, attr=slot)

    # Operations --------------------------------------------------------------------------

    def to_float(self, x: Node) -> Node:
        if x.kind == FLOAT:
            return x
        if x.is_const:
            return self.const(float(x.attr))
        return self.node("float", FLOAT, (x,))

    def unary(self, op: str, x: Node) -> Node:
        if op == "not":
            _need(op, x, BOOL)
            return self.const(not x.attr) if x.is_const else self.node("not", BOOL, (x,))
        _need_number(op, x)
        if op == "floor":
            if x.kind == INT:
                return x
            return self._fold(self.node("floor", INT, (x,)))
        if op == "neg":
            if x.op == "neg":
                return x.args[0]
            return self._fold(self.node("neg", x.kind, (x,)))
        if op == "abs":
            return self._fold(self.node("abs", x.kind, (x,)))
        if op in FLOAT_FUNCTIONS:
            return self._fold(self.node(op, FLOAT, (self.to_float(x),)))
        raise AssertionError(op)

    def power(self, x: Node, exponent) -> Node:
        """``x ** exponent`` for a Python number ``exponent``: an int power of an int stays an
        int (a negative one is refused, as NumPy refuses it); otherwise float."""
        _need_number("pow", x)
        if isinstance(exponent, (bool, np.bool_)) or not isinstance(exponent, (int, float, np.integer, np.floating)):
            raise TypeError(f"`**` takes a traced value ** a Python number, got an exponent of type "
                            f"{type(exponent).__name__}")
        if x.kind == INT and isinstance(exponent, (int, np.integer)):
            if exponent < 0:
                raise TypeError("`**` of an integer expression to a negative integer power (NumPy refuses it); "
                                "write a float exponent")
            return self._fold(self.node("ipow", INT, (x,), int(exponent)))
        exponent = float(exponent)
        if exponent == 1.0:
            return self.to_float(x)
        return self._fold(self.node("pow", FLOAT, (self.to_float(x),), exponent))

    def binary(self, op: str, a: Node, b: Node) -> Node:
        if op in LOGICAL:
            _need(op, a, BOOL)
            _need(op, b, BOOL)
            if a is b:
                return self.const(False) if op == "xor" else a
            return self._fold(self.node(op, BOOL, (a, b)))
        if op in ("eq", "ne") and a.kind == BOOL and b.kind == BOOL:
            return self.const(op == "eq") if a is b else self._fold(self.node(op, BOOL, (a, b)))
        _need_number(op, a)
        _need_number(op, b)
        if op in ("floordiv", "mod"):
            if a.kind != INT or b.kind != INT:
                raise TypeError(f"`{SYMBOLS[op]}` takes integer (index) expressions, got {a.kind} and {b.kind}")
            return self._fold(self.node(op, INT, (a, b)))
        kind = INT if a.kind == INT and b.kind == INT else FLOAT
        if op == "div":
            kind = FLOAT
        if kind == FLOAT:
            a, b = self.to_float(a), self.to_float(b)
        if op in COMPARISONS:
            if a is b and (kind == INT or op in ("lt", "gt")):   # float x <= x is false for NaN
                return self.const(op in ("le", "ge", "eq"))
            return self._fold(self.node(op, BOOL, (a, b)))
        simple = _identity(op, a, b)
        return simple if simple is not None else self._fold(self.node(op, kind, (a, b)))

    def where(self, cond: Node, a: Node, b: Node) -> Node:
        _need("where", cond, BOOL)
        if a.kind == BOOL or b.kind == BOOL:
            if a.kind != b.kind:
                raise TypeError(f"cuflash.where of a {a.kind} and a {b.kind}: both or neither must be bool")
            kind = BOOL
        else:
            kind = INT if a.kind == INT and b.kind == INT else FLOAT
            if kind == FLOAT:
                a, b = self.to_float(a), self.to_float(b)
        if cond.is_const:
            return a if cond.attr else b
        if a is b:
            return a
        return self.node("where", kind, (cond, a, b))

    def _fold(self, n: Node) -> Node:
        """A node whose operands are all constants becomes a constant (NumPy semantics, float64)."""
        if not n.args or not all(a.is_const for a in n.args):
            return n
        value = evaluate([n], {}, np.float64)[0]
        return self.const(value.item())


def _need(op, x: Node, kind):
    if x.kind != kind:
        raise TypeError(f"`{SYMBOLS[op]}` takes {kind} expressions, got a {x.kind} one")


def _need_number(op, x: Node):
    if x.kind == BOOL:
        raise TypeError(f"`{SYMBOLS[op]}` of a bool expression; use cuflash.where to turn a condition into a number")


def _identity(op, a: Node, b: Node):
    """x + 0, 0 + x, x - 0, x * 1, 1 * x and x / 1 are x (exact in IEEE arithmetic and in int64)."""
    def is_value(n, v):
        return n.is_const and n.attr == v and not (isinstance(n.attr, float) and np.signbit(n.attr))
    if op in ("add", "sub") and is_value(b, 0):
        return a
    if op == "add" and is_value(a, 0):
        return b
    if op in ("mul", "div") and is_value(b, 1):
        return a
    if op == "mul" and is_value(a, 1):
        return b
    return None


def topological(roots) -> list:
    """The nodes that ``roots`` depend on, operands before users, in a deterministic order."""
    order, seen = [], set()
    stack = [(r, False) for r in reversed(roots)]
    while stack:
        n, expanded = stack.pop()
        if id(n) in seen:
            continue
        if expanded:
            seen.add(id(n))
            order.append(n)
            continue
        stack.append((n, True))
        stack.extend((a, False) for a in reversed(n.args) if id(a) not in seen)
    return order


# ---------------------------------------------------------------------------------------------
# NumPy evaluation
# ---------------------------------------------------------------------------------------------

_NUMPY = {
    "neg": np.negative, "abs": np.abs, "exp": np.exp, "log": np.log, "tanh": np.tanh, "sqrt": np.sqrt,
    "not": np.logical_not, "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.true_divide,
    "floordiv": np.floor_divide, "mod": np.remainder, "min": np.minimum, "max": np.maximum, "lt": np.less,
    "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal, "eq": np.equal, "ne": np.not_equal,
    "and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor, "where": np.where,
}


def evaluate(roots, leaves: dict, float_dtype, load=None) -> list:
    """The values of ``roots`` as NumPy arrays (or scalars), floats in ``float_dtype``.

    ``leaves`` maps ``"score"`` and each index position (0, 1, ..., ``"q"``, ``"kv"``) to an
    array; ``load(slot, index_arrays)`` reads a captured array (already converted to the kind's
    NumPy dtype). Integer division by zero gives 0, as NumPy's does.
    """
    float_dtype = np.dtype(float_dtype)
    values = {}
    with np.errstate(all="ignore"):
        for n in topological(roots):
            args = [values[id(a)] for a in n.args]
            if n.op == "const":
                v = {FLOAT: float_dtype.type, INT: np.int64, BOOL: np.bool_}[n.kind](n.attr)
            elif n.op == "score":
                v = np.asarray(leaves["score"]).astype(float_dtype, copy=False)
            elif n.op == "index":
                v = np.asarray(leaves[n.attr], dtype=np.int64)
            elif n.op == "load":
                v = load(n.attr, args)
            elif n.op == "float":
                v = np.asarray(args[0]).astype(float_dtype)
            elif n.op == "floor":
                v = np.floor(args[0]).astype(np.int64)
            elif n.op == "ipow":
                v = np.power(args[0], np.int64(n.attr))
            elif n.op == "pow":
                v = np.power(args[0], float_dtype.type(n.attr))
            else:
                v = _NUMPY[n.op](*args)
            values[id(n)] = v
    return [values[id(r)] for r in roots]


# ---------------------------------------------------------------------------------------------
# Symbolic derivative
# ---------------------------------------------------------------------------------------------


def derivative(g: Graph, root: Node, wrt: Node) -> Node | None:
    """d root / d wrt as a float node, forward mode over the DAG; None where it is 0 everywhere
    (``root`` does not depend on ``wrt`` through float operations). Integer, bool, floor and
    comparison nodes carry no derivative; ``|x|`` has derivative ``-1`` for ``x < 0``, else 1;
    ``minimum`` / ``maximum`` take the derivative of the operand they return (the first on ties)."""
    memo = {}
    one = g.const(1.0)

    def mul(a, b):   # a * b with None as 0
        return None if a is None or b is None else g.binary("mul", a, b)

    def add(a, b):
        return b if a is None else a if b is None else g.binary("add", a, b)

    def d(n: Node):
        if id(n) in memo:
            return memo[id(n)]
        if n is wrt:
            r = one
        elif n.kind != FLOAT or n.op in ("const", "score", "index", "load", "float"):
            r = None
        else:
            ds = [d(a) for a in n.args]
            r = _rule(g, n, ds, mul, add)
        memo[id(n)] = r
        return r

    return d(root)


def _rule(g: Graph, n: Node, ds, mul, add):
    a = n.args[0]
    da = ds[0]
    if n.op == "where":
        _, da, db = ds
        if da is None and db is None:
            return None
        zero = g.const(0.0)
        return g.where(n.args[0], da or zero, db or zero)
    if n.op in ("add", "sub", "mul", "div", "min", "max"):
        b, db = n.args[1], ds[1]
        if n.op == "add":
            return add(da, db)
        if n.op == "sub":
            return add(da, None if db is None else g.unary("neg", db))
        if n.op == "mul":
            return add(mul(da, b), mul(a, db))
        if n.op == "div":   # da / b - a * db / b^2
            first = None if da is None else g.binary("div", da, b)
            second = None if db is None else g.binary("div", mul(a, db), g.binary("mul", b, b))
            return add(first, None if second is None else g.unary("neg", second))
        if da is None and db is None:
            return None
        zero = g.const(0.0)
        first = g.binary("le" if n.op == "min" else "ge", a, b)
        return g.where(first, da or zero, db or zero)
    if da is None:
        return None
    if n.op == "neg":
        return g.unary("neg", da)
    if n.op == "abs":
        return g.where(g.binary("lt", a, g.const(0.0)), g.unary("neg", da), da)
    if n.op == "exp":
        return mul(da, n)
    if n.op == "log":
        return g.binary("div", da, a)
    if n.op == "tanh":
        return mul(da, g.binary("sub", g.const(1.0), g.binary("mul", n, n)))
    if n.op == "sqrt":
        return g.binary("div", da, g.binary("mul", g.const(2.0), n))
    if n.op == "pow":   # c * a^(c - 1) * da
        c = n.attr
        power = g.power(a, c - 1.0) if c != 2.0 else a
        return mul(da, g.binary("mul", g.const(c), power) if c - 1.0 != 0.0 else g.const(c))
    raise AssertionError(n.op)
