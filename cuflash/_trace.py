"""User-defined score and mask functions: the `cuflash` functions they may call, their tracing
into an expression DAG (`cuflash._expr`), and their direct evaluation on NumPy arrays.

A function is traced by calling it once with proxy values (`Value`) for the score and the
indices, and with the arrays it reads from global or closure variables (its own, and those of
the plain Python functions it calls) replaced by `ArrayProxy` objects; what it does to them is
recorded. Python control flow on a traced value, functions other than the few below, and reads
of arrays that are not captured this way raise TypeError naming the operation and the line.

A trace is kept per function and signature: the number of batch dims, the dtype and shape of
each captured array (and which names share one array), the value of each captured Python number
(so a changed global number gives a new trace), and the code of the function and of those it
calls. The arrays' data are read at each call (`captured_arrays`), never kept. A call whose
function's variables hold the objects of its last walk, arrays of the same dtypes and shapes,
skips the walk (`_Walk`): it reads each variable and compares, holding nothing alive.
"""

from __future__ import annotations

import inspect
import linecache
import sys
import types
import weakref
from dataclasses import dataclass

import numpy as np

from . import _expr
from ._expr import BOOL, FLOAT, INT, Node

__all__ = ["where", "abs", "exp", "log", "tanh", "sqrt", "minimum", "maximum", "floor"]

MAX_DIMS = 6   # of a captured array; the generated code's descriptor holds this many

# Captured array dtypes and the kind of value a read gives.
_DTYPE_KINDS = {
    "bool": BOOL, "int8": INT, "uint8": INT, "int16": INT, "int32": INT, "int64": INT,
    "float16": FLOAT, "bfloat16": FLOAT, "float32": FLOAT,
}


# ---------------------------------------------------------------------------------------------
# The functions a score or mask function may call: on traced values, NumPy and CuPy arrays
# ---------------------------------------------------------------------------------------------


def _xp(*xs):
    """cupy for CuPy arguments, else numpy."""
    for x in xs:
        if type(x).__module__.split(".")[0] == "cupy":
            return sys.modules["cupy"]
    return np


def _traced(*xs):
    return next((x for x in xs if isinstance(x, Value)), None)


def _unary(op, name):
    def f(x):
        t = _traced(x)
        if t is not None:
            return t._unary(op)
        return getattr(_xp(x), name)(x)
    f.__name__ = f.__qualname__ = name
    f.__doc__ = f"Element-wise {name} of a traced value, a NumPy or CuPy array or a number."
    return f


exp = _unary("exp", "exp")
log = _unary("log", "log")
tanh = _unary("tanh", "tanh")
sqrt = _unary("sqrt", "sqrt")
abs = _unary("abs", "abs")   # noqa: A001 - the builtin's name, as in NumPy


def floor(x):
    """The floor of a float as an integer expression (int64), usable as an index; an integer
    stays as it is. On the GPU the float must be finite and within int64."""
    t = _traced(x)
    if t is not None:
        return t._unary("floor")
    xp = _xp(x)
    x = xp.asarray(x)
    return x if x.dtype.kind in "iu" else xp.floor(x).astype(xp.int64)


def where(cond, a, b):
    """``a`` where ``cond`` is true, else ``b`` (bool ``cond``; ``a`` and ``b`` both numbers or
    both bools)."""
    t = _traced(cond, a, b)
    if t is not None:
        g = t._graph
        return Value(g, g.where(*(_as_node(g, x, "cuflash.where") for x in (cond, a, b))))
    return _xp(cond, a, b).where(cond, a, b)


def _binary_function(op, name):
    def f(a, b):
        t = _traced(a, b)
        if t is not None:
            return t._binary(op, a, b)
        return getattr(_xp(a, b), name)(a, b)
    f.__name__ = f.__qualname__ = name
    f.__doc__ = f"Element-wise {name} (NaN if either is NaN) of traced values, arrays or numbers."
    return f


minimum = _binary_function("min", "minimum")
maximum = _binary_function("max", "maximum")


# ---------------------------------------------------------------------------------------------
# Traced values
# ---------------------------------------------------------------------------------------------


def _user_line() -> str:
    """`` (file:line: source)`` of the innermost frame outside cuflash, for error messages."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == "cuflash":
        frame = frame.f_back
    if frame is None:
        return ""
    code = frame.f_code
    line = linecache.getline(code.co_filename, frame.f_lineno).strip()
    return f" (in {code.co_name}, {code.co_filename}:{frame.f_lineno}{': ' + line if line else ''})"


def _refuse(what: str, advice: str):
    raise TypeError(f"{what} on a traced value{_user_line()}: {advice}")


def _as_node(g, x, op: str) -> Node:
    if isinstance(x, Value):
        if x._graph is not g:
            raise TypeError(f"{op} of values from two different traces")
        return x._node
    if isinstance(x, np.ndarray) and x.ndim == 0 and x.dtype.kind in "biuf":
        x = x[()]   # a cuflash function of constants gives a 0-dim array
    if isinstance(x, (bool, int, float, np.bool_, np.integer, np.floating)):
        return g.const(x.item() if isinstance(x, np.generic) else x)
    raise TypeError(f"{op} of a traced value and a {type(x).__name__}{_user_line()}: only traced values and "
                    "Python or NumPy numbers mix")


# NumPy ufuncs that are the operators (NumPy scalars reach a traced value through them).
_UFUNC_OPS = {
    "add": "add", "subtract": "sub", "multiply": "mul", "true_divide": "div", "divide": "div",
    "floor_divide": "floordiv", "remainder": "mod", "less": "lt", "less_equal": "le", "greater": "gt",
    "greater_equal": "ge", "equal": "eq", "not_equal": "ne", "bitwise_and": "and", "bitwise_or": "or",
    "bitwise_xor": "xor", "minimum": "min", "maximum": "max",
}


class Value:
    """A traced score, index or result: Python's operators record nodes of the graph."""

    __slots__ = ("_graph", "_node")
    __hash__ = None

    def __init__(self, graph, node):
        self._graph, self._node = graph, node

    def __repr__(self):
        return f"<traced {self._node.kind} {self._node.op}>"

    @property
    def kind(self) -> str:
        return self._node.kind

    def _unary(self, op):
        return Value(self._graph, self._graph.unary(op, self._node))

    def _binary(self, op, a, b):
        g = self._graph
        sym = _expr.SYMBOLS[op]
        return Value(g, g.binary(op, _as_node(g, a, sym), _as_node(g, b, sym)))

    def _op(op, reflected=False):  # noqa: N805 - builds the operator methods below
        def method(self, other):
            if not isinstance(other, (Value, bool, int, float, np.bool_, np.integer, np.floating)):
                return NotImplemented
            return self._binary(op, other, self) if reflected else self._binary(op, self, other)
        return method

    __add__, __radd__ = _op("add"), _op("add", True)
    __sub__, __rsub__ = _op("sub"), _op("sub", True)
    __mul__, __rmul__ = _op("mul"), _op("mul", True)
    __truediv__, __rtruediv__ = _op("div"), _op("div", True)
    __floordiv__, __rfloordiv__ = _op("floordiv"), _op("floordiv", True)
    __mod__, __rmod__ = _op("mod"), _op("mod", True)
    __and__, __rand__ = _op("and"), _op("and", True)
    __or__, __ror__ = _op("or"), _op("or", True)
    __xor__, __rxor__ = _op("xor"), _op("xor", True)
    __lt__, __le__, __gt__, __ge__ = _op("lt"), _op("le"), _op("gt"), _op("ge")
    __eq__, __ne__ = _op("eq"), _op("ne")
    del _op

    def __neg__(self):
        return self._unary("neg")

    def __pos__(self):
        if self.kind == BOOL:
            _refuse("unary +", "it takes a number")
        return self

    def __abs__(self):
        return self._unary("abs")

    def __invert__(self):
        return self._unary("not")

    def __pow__(self, exponent):
        if isinstance(exponent, Value):
            _refuse("`**` with a traced exponent", "the exponent must be a Python number")
        return Value(self._graph, self._graph.power(self._node, exponent))

    def __rpow__(self, base):
        _refuse("`**` with a traced exponent", "the exponent must be a Python number")

    def __bool__(self):
        _refuse("Python `if`, `while`, `and`, `or`, `not`, a chained comparison, min(), max() or bool()",
                "the value is not known while tracing; use cuflash.where, `&`, `|`, `~`, cuflash.minimum "
                "or cuflash.maximum")

    def __float__(self):
        _refuse("float(), or a math module function", "use cuflash.exp, cuflash.log, cuflash.tanh, cuflash.sqrt, "
                "abs, cuflash.floor")

    def __int__(self):
        _refuse("int()", "use cuflash.floor for the floor of a float as an integer")

    def __index__(self):
        _Trace.bad_index = True
        _refuse("use as a Python int (an index into a list, a tuple or an array the function does not read "
                "from a global or closure variable, range(), ...)",
                "index arrays that the function reads from its own global or closure variables")

    def __complex__(self):
        _refuse("complex()", "scores are real")

    def __floor__(self):
        _refuse("math.floor", "use cuflash.floor")

    def __ceil__(self):
        _refuse("math.ceil", "only cuflash.floor is available")

    def __trunc__(self):
        _refuse("math.trunc", "only cuflash.floor is available")

    def __round__(self, ndigits=None):
        _refuse("round()", "only cuflash.floor is available")

    def __iter__(self):
        _refuse("iteration", "a traced value is one number")

    def __getitem__(self, index):
        _refuse("indexing", "a traced value is one number")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        op = _UFUNC_OPS.get(ufunc.__name__)
        if method != "__call__" or op is None or len(inputs) != 2 or kwargs:
            _refuse(f"numpy.{ufunc.__name__}", "use the cuflash functions (cuflash.exp, cuflash.where, ...)")
        return self._binary(op, *inputs)

    def __array_function__(self, func, types_, args, kwargs):
        _refuse(f"numpy.{func.__name__}", "use the cuflash functions (cuflash.exp, cuflash.where, ...)")


# ---------------------------------------------------------------------------------------------
# Captured variables
# ---------------------------------------------------------------------------------------------


def _is_array(x) -> bool:
    return isinstance(x, np.ndarray) or (
        type(x).__module__.split(".")[0] == "cupy" and hasattr(x, "__cuda_array_interface__"))


def _is_number(x) -> bool:
    return isinstance(x, (bool, int, float, np.bool_, np.integer, np.floating))


def _user_function(x) -> bool:
    """Whether a walk goes into function ``x``: the user's, or cuflash's wrapper of the user's
    (`wrapper`); not cuflash's own (`where`, `exp`, ...), whose globals are not the user's."""
    return isinstance(x, types.FunctionType) and ((x.__module__ or "").split(".")[0] != "cuflash" or
                                                  getattr(x, "_cuflash_wrapper", False))


def wrapper(fn):
    """Marks ``fn``, a function of cuflash's that calls a user's function with other indices (the
    torch adapter's grouped heads, the KV cache's positions), as one that a walk goes into, so that
    a function that calls it captures what the user's captures."""
    fn._cuflash_wrapper = True
    return fn


def _variables(fn):
    """(name, value) of ``fn``'s closure variables, then of the globals its code names, in
    order. Free variables not yet bound are left out."""
    code = fn.__code__
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            yield name, cell.cell_contents
        except ValueError:
            continue
    names = set()
    for c in (code, *(k for k in code.co_consts if isinstance(k, types.CodeType))):
        for name in c.co_names:
            if name in fn.__globals__ and name not in names:
                names.add(name)
                yield name, fn.__globals__[name]


def _array_or_number(x) -> bool:
    return _is_array(x) or _is_number(x)


def _walk(fn, visit, seen=None, leaf=_array_or_number):
    """Calls ``visit(path, value)`` for every captured array and number (every value ``leaf``
    accepts) of ``fn`` and of the user functions it refers to (depth first, each function once);
    ``path`` is ``"fn.name"``."""
    seen = set() if seen is None else seen
    seen.add(id(fn))
    for name, value in _variables(fn):
        if _user_function(value):
            if id(value) not in seen:
                _walk(value, visit, seen, leaf)
        elif leaf(value):
            visit(f"{fn.__qualname__}.{name}", value)


def captured_values(fn, leaf) -> list:
    """The values ``leaf`` accepts that ``fn`` and the user functions it calls capture, in walk
    order (each once)."""
    found = {}
    _walk(fn, lambda path, value: found.setdefault(id(value), value), leaf=leaf)
    return list(found.values())


def rebind(fn, replace, leaf) -> types.FunctionType:
    """A copy of ``fn`` whose captured values that ``leaf`` accepts are ``replace(value)``, in it
    and in the user functions it calls: for an adapter whose callers capture their framework's
    tensors (cuflash.torch)."""
    return _rebind(fn, lambda path, value: replace(value), leaf=leaf)


def _rebind(fn, replace, memo=None, leaf=_is_array):
    """A copy of ``fn`` whose captured arrays (values ``leaf`` accepts) are ``replace(path,
    array)`` in it and in the user functions it calls (recursively)."""
    memo = {} if memo is None else memo
    if id(fn) in memo:
        return memo[id(fn)]
    new_globals = dict(fn.__globals__)
    cells = []
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            cells.append(types.CellType(cell.cell_contents))
        except ValueError:
            cells.append(types.CellType())
    new = types.FunctionType(fn.__code__, new_globals, fn.__name__, fn.__defaults__, tuple(cells) or None)
    new.__kwdefaults__ = fn.__kwdefaults__
    memo[id(fn)] = new
    by_name = dict(zip(fn.__code__.co_freevars, cells))
    for name, value in list(_variables(fn)):
        if _user_function(value):
            value = _rebind(value, replace, memo, leaf)
        elif leaf(value):
            value = replace(f"{fn.__qualname__}.{name}", value)
        else:
            continue
        if name in by_name:
            by_name[name].cell_contents = value
        else:
            new_globals[name] = value
    return new


def _dtype_name(x) -> str:
    return np.dtype(x.dtype).name


@dataclass(frozen=True)
class Capture:
    """A captured array the function reads: where it was found, dtype, ndim, its reads' kind."""

    path: str
    dtype: str
    ndim: int
    kind: str


class ArrayProxy:
    """A captured array while tracing: reads with integer index expressions become load nodes."""

    def __init__(self, trace, path, array):
        self._trace, self._path, self._array = trace, path, array
        self.shape, self.ndim, self.dtype = tuple(array.shape), array.ndim, array.dtype

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        if len(index) != self.ndim:
            raise TypeError(f"captured array {self._path} has {self.ndim} dims but is read with {len(index)} "
                            f"indices{_user_line()}: read one element, with one integer index per dim")
        g = self._trace.graph
        nodes = []
        for i, x in enumerate(index):
            if isinstance(x, np.ndarray) and x.ndim == 0 and x.dtype.kind in "iu":
                x = x[()]
            if isinstance(x, Value) or (isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))):
                nodes.append(_as_node(g, x, "indexing"))
            else:
                raise TypeError(f"captured array {self._path} read with index {i} of type {type(x).__name__}"
                                f"{_user_line()}: indices must be integer expressions (no slices, ...)")
        slot, kind = self._trace.slot(self._path, self._array)
        return Value(g, g.load(slot, kind, tuple(nodes)))

    def __getattr__(self, name):
        raise TypeError(f"captured array {self._path}: .{name} while tracing{_user_line()}; only reads of one "
                        "element, .shape, .ndim and .dtype")


def check_capture(path: str, array) -> str:
    """The kind of value a captured array's reads give; TypeError for a dtype the kernels do not
    read, ValueError for an array with no element or too many dims."""
    kind = _DTYPE_KINDS.get(_dtype_name(array))
    if kind is None:
        raise TypeError(f"captured array {path} has dtype {_dtype_name(array)}; supported: "
                        f"{', '.join(_DTYPE_KINDS)}")
    if array.ndim > MAX_DIMS:
        raise ValueError(f"captured array {path} has {array.ndim} dims, more than {MAX_DIMS}")
    if 0 in array.shape:
        raise ValueError(f"captured array {path} has shape {tuple(array.shape)}: no element to read")
    return kind


# ---------------------------------------------------------------------------------------------
# Tracing
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Read:
    """A read of a float captured array by a score function, and d(result) / d(read)."""

    node: Node
    derivative: Node

    @property
    def slot(self) -> int:
        return self.node.attr

    @property
    def additive(self) -> bool:
        """Whether the result is ``read + (the rest)``: the gradient is dS itself."""
        return self.derivative.is_const and self.derivative.attr == 1.0


@dataclass(frozen=True)
class Traced:
    """A traced score function (``role`` ``"score_mod"``) or mask function (``"mask_mod"``).

    ``result``: the function's value (float or bool); ``dscore``: d(result) / d(score) (score
    functions; the constant 0 where the score does not reach the result); ``captures``: the
    arrays it reads, slot by slot; ``positions``: each slot's place among the captured arrays of
    `captured_arrays`; ``reads``: the float reads the gradient reaches (score functions)."""

    role: str
    batch_dims: int
    graph: _expr.Graph
    result: Node
    dscore: Node | None
    captures: tuple
    positions: tuple
    reads: tuple

    @property
    def index_names(self) -> tuple:
        return tuple(f"b{i}" for i in range(self.batch_dims)) + ("q_idx", "kv_idx")


class _Trace:
    bad_index = False   # set when a traced value was asked for a Python int (a foreign array read)

    def __init__(self):
        self.graph = _expr.Graph()
        self.captures, self.slots, self.positions = [], {}, []
        self.order = {}   # id(array) -> its place among all captured arrays

    def slot(self, path, array):
        key = id(array)
        if key not in self.slots:
            self.slots[key] = (len(self.captures), check_capture(path, array))
            self.captures.append(Capture(path, _dtype_name(array), array.ndim, self.slots[key][1]))
            self.positions.append(self.order[key])
        return self.slots[key]


def _captured(fn):
    """The captured arrays (each once, in walk order), their places in that order by id, and the
    signature part of captures (an array's place in it: two names of one array read one slot)."""
    arrays, order, signature = [], {}, []

    def visit(path, value):
        if _is_array(value):
            if id(value) not in order:
                order[id(value)] = len(arrays)
                arrays.append(value)
            # (the dtype: its name is slow to get)
            signature.append((path, value.dtype, tuple(value.shape), order[id(value)]))
        else:
            signature.append((path, type(value).__name__, repr(value)))

    _walk(fn, visit)
    return arrays, order, tuple(signature)


class _Sentinel:
    """A marker a weak reference can point to."""


_UNBOUND, _ABSENT, _PASSED_OVER = _Sentinel(), _Sentinel(), _Sentinel()


def _names(code) -> tuple:
    """The names ``code`` and the code objects it holds look up, each once (those `_variables`
    looks for in the globals)."""
    codes = (code, *(c for c in code.co_consts if isinstance(c, types.CodeType)))
    return tuple(dict.fromkeys(name for c in codes for name in c.co_names))


def _place_values(fn, names) -> list:
    """What ``fn``'s closure cells hold (`_UNBOUND` for an empty one), then its globals under
    ``names`` (`_ABSENT` for a missing one)."""
    values = []
    for cell in fn.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:
            values.append(_UNBOUND)
    if names:
        found = fn.__globals__
        values += [found.get(name, _ABSENT) for name in names]
    return values


def _expected(value):
    """How a later call tells that a place still holds ``value``: a weak reference where it takes
    one (arrays, functions, modules: a walk keeps nothing alive), the number itself (immutable),
    else `_PASSED_OVER` (a value a walk passes over, which must stay one)."""
    try:
        return weakref.ref(value)
    except TypeError:
        return (lambda: value) if _is_number(value) else _PASSED_OVER


class _Walk:
    """What `_captured` found for a function, and what it read: the code of each function it
    walked, and the value in each closure cell and global their code names. A later call whose
    functions have the same code, whose places hold the same objects and whose captured arrays
    have the same dtypes and shapes would find the same, so it skips the walk (a repeat call's
    host time); anything else walks again."""

    def __init__(self, fn, arrays, order, signature):
        self.order = order
        self.arrays = [weakref.ref(a) for a in arrays]
        self.layouts = [(a.dtype, tuple(a.shape)) for a in arrays]
        self.traces = {}   # (role, batch_dims) -> Traced, for this signature
        self.functions, self.expected = [], []   # (weak reference, code, names) of each; per place
        pending, seen = [fn], {id(fn)}
        while pending:   # (the functions `_walk` reaches, in another order)
            f = pending.pop()
            code = f.__code__
            names = _names(code)
            self.functions.append((weakref.ref(f), code, names))
            for value in _place_values(f, names):
                self.expected.append(_expected(value))
                if _user_function(value) and id(value) not in seen:
                    seen.add(id(value))
                    pending.append(value)
        # (with the functions' code: another helper function, or new code, is another trace)
        self.signature = (signature, tuple(code for _, code, _ in self.functions))

    def arrays_now(self) -> list | None:
        """The captured arrays in walk order, or None where a walk might now find otherwise."""
        values = []
        for ref, code, names in self.functions:
            f = ref()
            if f is None or f.__code__ is not code:
                return None
            values += _place_values(f, names)
        for value, expected in zip(values, self.expected):
            if expected is _PASSED_OVER:
                if _user_function(value) or _array_or_number(value):
                    return None
            elif value is None or expected() is not value:   # (a dead reference gives None)
                return None
        arrays = [ref() for ref in self.arrays]   # (alive: their places hold them)
        for a, (dtype, shape) in zip(arrays, self.layouts):
            if a.dtype != dtype or a.shape != shape:
                return None
        return arrays


class _Kept:
    """A function's traces by signature, and its last walk."""

    __slots__ = ("traces", "walk")

    def __init__(self):
        self.traces, self.walk = {}, None


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def trace(fn, role: str, batch_dims: int) -> Traced:
    """The trace of score function (``role="score_mod"``) or mask function (``"mask_mod"``)
    ``fn`` for ``batch_dims`` batch dims, from the cache when its signature was traced before."""
    return trace_call(fn, role, batch_dims)[0]


def trace_call(fn, role: str, batch_dims: int) -> tuple[Traced, list]:
    """`trace`, and the arrays ``fn`` reads now in the trace's slots (as `captured_arrays`
    gives them: one walk of the function for both, where a call needs both; none where the
    function's last walk still holds, `_Walk`)."""
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"{role} must be a Python function (def or lambda), got {type(fn).__name__}")
    kept, arrays = _walked(fn)
    walk = kept.walk
    traced = walk.traces.get((role, batch_dims))
    if traced is None:
        key = (role, batch_dims, walk.signature)
        traced = kept.traces.get(key)
        if traced is None:   # (a function that breaks the rules raises here, at every call)
            traced = kept.traces[key] = _trace(fn, role, batch_dims, arrays, walk.order)
        walk.traces[(role, batch_dims)] = traced
    return traced, _in_slots(arrays, traced)


def _walked(fn) -> tuple[_Kept, list]:
    """What is kept for ``fn``, its walk current, and the arrays it captures now (walk order)."""
    kept = _CACHE.get(fn)
    if kept is None:
        kept = _CACHE.setdefault(fn, _Kept())
    arrays = None if kept.walk is None else kept.walk.arrays_now()
    if arrays is None:
        arrays, order, signature = _captured(fn)
        kept.walk = _Walk(fn, arrays, order, signature)
    return kept, arrays


def gradient_slots(traced: Traced | None, arrays, wanted) -> tuple:
    """The slot of each array of ``wanted`` (a call's ``score_mod_grads``) among ``arrays``, the
    arrays the score function ``traced`` reads now in its slots: ValueError without a score
    function, TypeError for an array it does not read (from a global or closure variable) or one
    that is not float. None for None."""
    if wanted is None:
        return None
    if traced is None:
        raise ValueError("score_mod_grads needs a score_mod")
    if isinstance(wanted, (str, bytes)) or not hasattr(wanted, "__iter__") or hasattr(wanted, "shape"):
        raise TypeError(f"score_mod_grads must be a sequence of arrays, got {type(wanted).__name__}")
    slots = []
    for i, x in enumerate(wanted):
        slot = next((s for s, a in enumerate(arrays) if a is x), None)
        if slot is None:
            raise TypeError(f"score_mod_grads[{i}] is not an array that score_mod reads from a global or closure "
                            "variable")
        capture = traced.captures[slot]
        if capture.kind != "float":
            raise TypeError(f"score_mod_grads[{i}] ({capture.path}) has dtype {capture.dtype}: no gradient")
        slots.append(slot)
    return tuple(slots)


def captured_arrays(fn, traced: Traced) -> list:
    """The arrays ``fn`` reads now, in ``traced``'s slots (``traced`` from `trace` of the same call:
    their dtypes and shapes are the traced ones, their data are read here, never kept)."""
    return _in_slots(_walked(fn)[1], traced)


def _in_slots(arrays, traced: Traced) -> list:
    """Captured arrays (in walk order) in ``traced``'s slots."""
    return [arrays[p] for p in traced.positions]


def check_devices(traced: Traced, arrays, device: int) -> None:
    """For a GPU call on ``device``: TypeError naming the first captured array (``arrays`` from
    `captured_arrays`) that is not a CuPy array on that device."""
    for capture, a in zip(traced.captures, arrays):
        if not _is_array(a) or isinstance(a, np.ndarray):
            raise TypeError(f"{traced.role} reads {capture.path}, a NumPy array; the GPU functions read captured "
                            f"arrays on q's device {device}: capture a CuPy array (cupy.asarray)")
        if a.device.id != device:
            raise TypeError(f"{traced.role} reads {capture.path} on device {a.device.id}, but q is on device "
                            f"{device}")


def _trace(fn, role, batch_dims, arrays, order) -> Traced:
    t = _Trace()
    t.order = order
    g = t.graph
    proxied = _rebind(fn, lambda path, a: ArrayProxy(t, path, a))
    indices = [Value(g, g.index(i)) for i in range(batch_dims)] + [Value(g, g.index("q")), Value(g, g.index("kv"))]
    args = ([Value(g, g.score())] if role == "score_mod" else []) + indices
    try:
        inspect.signature(fn).bind(*args)
    except TypeError:
        names = (["score"] if role == "score_mod" else []) + [f"b{i}" for i in range(batch_dims)] + ["q_idx", "kv_idx"]
        raise TypeError(f"{role} is called with {len(args)} arguments, ({', '.join(names)}): one index per batch "
                        f"dim ({batch_dims} here), but its signature is {inspect.signature(fn)}") from None
    _Trace.bad_index = False
    try:
        result = proxied(*args)
    except IndexError as err:
        if not _Trace.bad_index:
            raise
        raise TypeError(f"{role} indexed an array with a traced value, but the array is not one it reads from "
                        "a global or closure variable (only those are captured)") from err
    try:
        node = _as_node(g, result, "the result")
    except TypeError:
        raise TypeError(f"{role} returned a {type(result).__name__}; it must return an expression of its "
                        "arguments or a number") from None
    if role == "mask_mod":
        if node.kind != BOOL:
            raise TypeError(f"mask_mod returned a {node.kind} expression; it must return a bool (a comparison, "
                            "`&`, `|`, `~` of comparisons, or a bool array read)")
        return Traced(role, batch_dims, g, node, None, tuple(t.captures), tuple(t.positions), ())
    if node.kind == BOOL:
        raise TypeError("score_mod returned a bool expression; it must return a number (the new score)")
    node = g.to_float(node)
    dscore = _expr.derivative(g, node, g.score()) or g.const(0.0)
    reads = []
    for n in _expr.topological([node]):
        if n.op == "load" and n.kind == FLOAT:
            d = _expr.derivative(g, node, n)
            if d is not None:
                reads.append(Read(n, d))
    return Traced(role, batch_dims, g, node, dscore, tuple(t.captures), tuple(t.positions), tuple(reads))


# ---------------------------------------------------------------------------------------------
# NumPy evaluation: the function itself on index grids, and the DAG
# ---------------------------------------------------------------------------------------------


def host_array(x) -> np.ndarray:
    """A captured array's values on the host (CuPy arrays through ``.get()``)."""
    return x.get() if type(x).__module__.split(".")[0] == "cupy" else np.asarray(x)


_HOST_TYPES = {FLOAT: np.float64, INT: np.int64, BOOL: np.bool_}


def read(array: np.ndarray, index, dtype=None):
    """``array[index]`` with each index clamped to ``[0, n - 1]`` of its dim (the rule of the
    generated code: a read never leaves the array); values as float64 / int64 / bool (or as
    ``dtype`` for floats)."""
    index = tuple(np.clip(np.asarray(i, dtype=np.int64), 0, n - 1) for i, n in zip(index, array.shape))
    kind = _DTYPE_KINDS[_dtype_name(array)]
    return array[index].astype(dtype if dtype is not None and kind == FLOAT else _HOST_TYPES[kind])


class _ClampedArray:
    """A captured array in a direct NumPy call: reads follow `read`'s rule."""

    def __init__(self, path, array):
        check_capture(path, array)
        self._array = host_array(array)
        self.shape, self.ndim, self.dtype = self._array.shape, self._array.ndim, self._array.dtype

    def __getitem__(self, index):
        return read(self._array, index if isinstance(index, tuple) else (index,))


def index_grids(batch: tuple, rows, keys) -> list:
    """Broadcastable int64 grids of the batch indices (one per batch dim), the rows and the keys:
    shapes ``batch``-like + (len(rows), len(keys))."""
    n = len(batch)
    grids = [np.arange(size).reshape((1,) * d + (size,) + (1,) * (n - d - 1) + (1, 1))
             for d, size in enumerate(batch)]
    return grids + [np.asarray(rows, dtype=np.int64)[:, None], np.asarray(keys, dtype=np.int64)[None, :]]


def call(fn, *args):
    """``fn(*args)`` on NumPy arrays, its captured arrays read through `read` (float64 math)."""
    with np.errstate(all="ignore"):
        return _rebind(fn, _ClampedArray)(*args)


def evaluate(roots, score, grids, arrays, float_dtype=np.float64) -> list:
    """The values of nodes ``roots`` of a trace on NumPy inputs: ``score``, the index
    ``grids`` (as from `index_grids`) and the captured ``arrays`` in slot order."""
    leaves = {i: x for i, x in enumerate(grids[:-2])}
    leaves.update(score=score, q=grids[-2], kv=grids[-1])
    hosts = [host_array(a) for a in arrays]
    return _expr.evaluate(roots, leaves, float_dtype, lambda slot, idx: read(hosts[slot], idx, float_dtype))


class HostFunction:
    """A score or mask function as the reference runs it: traced once (so the rules hold, with
    their TypeErrors), then called on NumPy index grids, its captured arrays read on the host."""

    def __init__(self, fn, role: str, batch_dims: int):
        self.fn, self.traced = fn, trace(fn, role, batch_dims)
        self.arrays = [host_array(a) for a in captured_arrays(fn, self.traced)]

    def __call__(self, *args):
        return call(self.fn, *args)

    def evaluate(self, roots, score, grids) -> list:
        return evaluate(roots, score, grids, self.arrays)
