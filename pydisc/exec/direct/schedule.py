"""The host side of a compiled module, as data: what to launch, in which order, with which sizes.

IREE compiles a cluster's `main` into host code that imports the arguments, allocates transient
buffers, and records dispatches, fills and copies into a command buffer for its own stream. The same
text compiled with `--compile-to=executable-targets` shows that host code as MLIR (`stream` dialect):

    %d = hal.buffer_view.dim<%arg2>[0]                          -> a size read from an argument
    %t = stream.resource.alloca ... {%n}                         -> a transient buffer of n bytes
    stream.cmd.execute ... { stream.cmd.dispatch @exe::@variant::@kernel[%workload](%c0, %c1 : i32, i32)
                             { ro %arg8[%off for %len], wo %t[...] }  stream.cmd.copy / stream.cmd.fill }
    hal.executable.export @kernel ... count(%device, %w) { ... hal.return %x, %y, %z }   -> the grid

`extract_schedule` walks that MLIR with the MLIR Python bindings shipped in iree-base-compiler and
turns it into a `Schedule`: a straight-line integer program (sizes, offsets, grids, push constants,
evaluated from the argument dims of each call, once per distinct shape) and a list of commands over
buffers (arguments and transients). It accepts only the constructs listed here; anything else raises
`LaunchUnsupported` and the cluster runs through IREE's runtime instead. The format is specific to the
pinned IREE version (3.13), which is part of every compile-cache key.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from iree.compiler import ir

from .errors import LaunchUnsupported

__all__ = ["Schedule", "extract_schedule"]

_MASK64 = (1 << 64) - 1

# arith ops on integers: name -> (function of (a, b, width) on unsigned representations)


def _signed(x: int, width: int) -> int:
    return x - (1 << width) if x >> (width - 1) & 1 else x


def _floordiv(a: int, b: int) -> int:
    return a // b


def _ceildiv(a: int, b: int) -> int:
    return -(-a // b)


def _truncdiv(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


_BINARY = {
    "arith.addi": lambda a, b, w: a + b,
    "arith.subi": lambda a, b, w: a - b,
    "arith.muli": lambda a, b, w: a * b,
    "arith.divui": lambda a, b, w: a // b,
    "arith.divsi": lambda a, b, w: _truncdiv(_signed(a, w), _signed(b, w)),
    "arith.ceildivui": lambda a, b, w: _ceildiv(a, b),
    "arith.ceildivsi": lambda a, b, w: _ceildiv(_signed(a, w), _signed(b, w)),
    "arith.floordivsi": lambda a, b, w: _floordiv(_signed(a, w), _signed(b, w)),
    "arith.remui": lambda a, b, w: a % b,
    "arith.remsi": lambda a, b, w: _signed(a, w) - _truncdiv(_signed(a, w), _signed(b, w)) * _signed(b, w),
    "arith.shrui": lambda a, b, w: a >> b,
    "arith.shrsi": lambda a, b, w: _signed(a, w) >> b,
    "arith.shli": lambda a, b, w: a << b,
    "arith.andi": lambda a, b, w: a & b,
    "arith.ori": lambda a, b, w: a | b,
    "arith.xori": lambda a, b, w: a ^ b,
    "arith.maxui": lambda a, b, w: max(a, b),
    "arith.minui": lambda a, b, w: min(a, b),
    "arith.maxsi": lambda a, b, w: max(_signed(a, w), _signed(b, w)),
    "arith.minsi": lambda a, b, w: min(_signed(a, w), _signed(b, w)),
}
_CASTS = {"arith.index_cast": True, "arith.index_castui": False, "arith.trunci": False,
          "arith.extui": False, "arith.extsi": True}
# arith.cmpi predicates, in MLIR's enum order
_COMPARE = ("eq", "ne", "slt", "sle", "sgt", "sge", "ult", "ule", "ugt", "uge")
# host ops that only order work on IREE's own stream or check what pydisc guarantees (shapes, dtypes)
_IGNORED = {"hal.encoding_type", "stream.resource.dealloca",
            "stream.timepoint.immediate", "stream.timepoint.join", "stream.timepoint.barrier"}
_IGNORED_COMMANDS = {"stream.yield", "stream.cmd.flush", "stream.cmd.invalidate", "stream.cmd.discard"}


@dataclass
class Schedule:
    """What one call does, with every size an integer-program value id.

    - `reads`: the program's inputs, `(argument, dim)` (`dim` -1: the argument is an int);
    - `shapes`: per tensor argument, `[element bytes, [dim value ids]]` as IREE's own call checks them
      (`hal.buffer_view.assert`), or None;
    - `program`: instructions `[op, result, ...]` (see `evaluate`);
    - `transients`: value ids of the byte sizes of the transient buffers;
    - `written`: the arguments some command writes (IREE may write an input in place when it ties a
      result to it, e.g. a scatter's operand): the launcher copies such inputs first;
    - `commands`: `["dispatch", kernel, [grid x, y, z], [push constants], [[buffer, offset, length]...]]`,
      `["copy", src, src_offset, dst, dst_offset, length]`, `["fill", buffer, offset, length, value,
      bytes]`; a buffer is `["arg", position]` or `["transient", index]`.
    """

    arguments: int
    reads: list
    shapes: list
    program: list
    widths: list
    transients: list
    commands: list
    written: list

    def to_json(self) -> str:
        return json.dumps(self.__dict__, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        return cls(**json.loads(text))

    def evaluate(self, read_values: tuple) -> list[int]:
        """Every value of the program for one call's sizes (`read_values`, in `reads` order)."""
        values = [0] * len(self.widths)
        widths = self.widths
        for ins in self.program:
            op, out = ins[0], ins[1]
            if op == "const":
                v = ins[2]
            elif op == "read":
                v = read_values[ins[2]]
            elif op == "bin":
                v = _BINARY[ins[2]](values[ins[3]], values[ins[4]], widths[ins[1]])
            elif op == "cast":
                v = values[ins[2]]
                if ins[3]:                      # sign-extending from the source width
                    v = _signed(v, widths[ins[2]])
            elif op == "select":
                v = values[ins[3]] if values[ins[2]] & 1 else values[ins[4]]
            elif op == "cmp":
                a, b, pred = values[ins[3]], values[ins[4]], ins[2]
                w = widths[ins[3]]
                if pred[0] == "s":
                    a, b = _signed(a, w), _signed(b, w)
                v = int({"eq": a == b, "ne": a != b, "lt": a < b, "le": a <= b, "gt": a > b,
                         "ge": a >= b}[pred[-2:] if pred not in ("eq", "ne") else pred])
            elif op == "align":
                a, b = values[ins[2]], values[ins[3]]
                v = (a + b - 1) // b * b
            elif op == "affine":
                kind, exprs, operands, n_dims = ins[2], ins[3], ins[4], ins[5]
                args = [_signed(values[o], widths[o]) for o in operands]
                results = [_affine(e, args, n_dims) for e in exprs]
                v = results[0] if kind == "apply" else (min(results) if kind == "min" else max(results))
            else:  # pragma: no cover - extract_schedule emits only the ops above
                raise AssertionError(op)
            values[out] = v & ((1 << widths[out]) - 1)
        return values


def _affine(expr, args: list[int], n_dims: int) -> int:
    kind = expr[0]
    if kind == "c":
        return expr[1]
    if kind == "d":
        return args[expr[1]]
    if kind == "s":
        return args[n_dims + expr[1]]
    a, b = _affine(expr[1], args, n_dims), _affine(expr[2], args, n_dims)
    if kind == "+":
        return a + b
    if kind == "*":
        return a * b
    if kind == "mod":
        return a % b
    if kind == "floordiv":
        return a // b
    return -(-a // b)                           # ceildiv


# -- extraction ----------------------------------------------------------------------------------------


def _width(type_) -> int:
    name = str(type_)
    if name == "index":
        return 64
    if name.startswith("i") and name[1:].isdigit():
        return int(name[1:])
    raise LaunchUnsupported("host value of type %s" % name)


def _int_attr(attr) -> int:
    return ir.IntegerAttr(attr).value


def _affine_tree(expr):
    e = expr.maybe_downcast()
    if isinstance(e, ir.AffineConstantExpr):
        return ("c", e.value)
    if isinstance(e, ir.AffineDimExpr):
        return ("d", e.position)
    if isinstance(e, ir.AffineSymbolExpr):
        return ("s", e.position)
    kinds = ((ir.AffineAddExpr, "+"), (ir.AffineMulExpr, "*"), (ir.AffineModExpr, "mod"),
             (ir.AffineFloorDivExpr, "floordiv"), (ir.AffineCeilDivExpr, "ceildiv"))
    for cls, kind in kinds:
        if isinstance(e, cls):
            return (kind, _affine_tree(e.lhs), _affine_tree(e.rhs))
    raise LaunchUnsupported("affine expression %s" % expr)


class _Extractor:
    def __init__(self, arguments: int) -> None:
        self.arguments = arguments
        self.reads: list = []
        self.program: list = []
        self.widths: list = []
        self.transients: list = []
        self.commands: list = []
        self.ints: dict = {}        # mlir Value -> value id
        self.buffers: dict = {}     # mlir Value -> (["arg", k] | ["transient", j], byte offset id | None)
        self.views: dict = {}       # mlir Value (a !hal.buffer_view function argument) -> position
        self.exports: dict = {}     # mlir Value (an exported result) -> ((buffer, offset id), size id)
        self.constants: dict = {}   # (value, width) -> id, so repeated constants share an id
        self.kernels: dict = {}     # kernel name -> the block of its workgroup-count region
        self.shapes: list = [None] * arguments
        self.written: list = []
        self.element_types: dict = {}   # mlir Value of a hal.element_type -> element bytes

    def new(self, width: int) -> int:
        self.widths.append(width)
        return len(self.widths) - 1

    def const(self, value: int, width: int) -> int:
        key = (value, width)
        if key not in self.constants:
            out = self.new(width)
            self.program.append(["const", out, value & ((1 << width) - 1)])
            self.constants[key] = out
        return self.constants[key]

    def int_of(self, value) -> int:
        try:
            return self.ints[value]
        except KeyError:
            raise LaunchUnsupported("a size computed by an op the launcher does not read: %s"
                                    % str(value.owner.name if hasattr(value.owner, "name") else value)) from None

    def buffer_of(self, value) -> tuple:
        try:
            return self.buffers[value]
        except KeyError:
            raise LaunchUnsupported("a buffer that is neither an argument nor a transient (a constant "
                                    "or a global resource)") from None

    def wrote(self, base: list) -> None:
        if base[0] == "arg" and base[1] not in self.written:
            self.written.append(base[1])

    def at(self, value, offset: int) -> tuple[list, int]:
        """(base buffer, value id of the byte offset) of `value[offset]`, through subviews."""
        base, sub = self.buffer_of(value)
        if sub is None:
            return base, offset
        out = self.new(64)
        self.program.append(["bin", out, "arith.addi", sub, offset])
        return base, out

    # integer ops, shared by the host function and the workgroup-count regions
    def integer_op(self, op) -> bool:
        name = op.name
        if name == "arith.constant":
            if len(op.results) != 1:
                return False
            width = _width(op.results[0].type)
            self.ints[op.results[0]] = self.const(_int_attr(op.attributes["value"]), width)
        elif name in _BINARY:
            out = self.new(_width(op.results[0].type))
            self.program.append(["bin", out, name, self.int_of(op.operands[0]), self.int_of(op.operands[1])])
            self.ints[op.results[0]] = out
        elif name in _CASTS:
            out = self.new(_width(op.results[0].type))
            self.program.append(["cast", out, self.int_of(op.operands[0]), _CASTS[name]])
            self.ints[op.results[0]] = out
        elif name == "arith.select":
            out = self.new(_width(op.results[0].type))
            self.program.append(["select", out, *(self.int_of(v) for v in op.operands)])
            self.ints[op.results[0]] = out
        elif name == "arith.cmpi":
            out = self.new(1)
            predicate = _COMPARE[_int_attr(op.attributes["predicate"])]
            self.program.append(["cmp", out, predicate, self.int_of(op.operands[0]), self.int_of(op.operands[1])])
            self.ints[op.results[0]] = out
        elif name == "util.assume.int":
            # what the emitter told IREE about a size (a multiple of 8, emit.emit_cluster): nothing to compute
            for result, operand in zip(op.results, op.operands):
                self.ints[result] = self.int_of(operand)
        elif name == "util.align":
            out = self.new(_width(op.results[0].type))
            self.program.append(["align", out, self.int_of(op.operands[0]), self.int_of(op.operands[1])])
            self.ints[op.results[0]] = out
        elif name in ("affine.apply", "affine.min", "affine.max"):
            amap = ir.AffineMapAttr(op.attributes["map"]).value
            out = self.new(64)
            self.program.append(["affine", out, name.split(".")[1], [_affine_tree(e) for e in amap.results],
                                 [self.int_of(v) for v in op.operands], amap.n_dims])
            self.ints[op.results[0]] = out
        else:
            return False
        return True

    def collect_kernels(self, module) -> None:
        for top in module.body.operations:
            if top.operation.name != "hal.executable":
                continue
            for variant in top.regions[0].blocks[0].operations:
                if variant.operation.name != "hal.executable.variant":
                    continue
                for export in variant.regions[0].blocks[0].operations:
                    if export.operation.name != "hal.executable.export":
                        continue
                    name = str(export.attributes["sym_name"]).strip('"')
                    if not export.regions or not export.regions[0].blocks:
                        raise LaunchUnsupported("kernel %s has no workgroup count region" % name)
                    self.kernels[name] = export.regions[0].blocks[0]

    def grid(self, kernel: str, workload: list[int]) -> list[int]:
        block = self.kernels.get(kernel)
        if block is None:
            raise LaunchUnsupported("dispatch of unknown kernel %s" % kernel)
        arguments = list(block.arguments)
        if len(arguments) != len(workload) + 1:
            raise LaunchUnsupported("kernel %s: workload arity differs from its count region" % kernel)
        for arg, value in zip(arguments[1:], workload):
            self.ints[arg] = value
        for op in block.operations:
            op = op.operation
            if op.name == "hal.return":
                return [self.int_of(v) for v in op.operands]
            if not self.integer_op(op):
                raise LaunchUnsupported("kernel %s: workgroup count uses %s" % (kernel, op.name))
        raise LaunchUnsupported("kernel %s: count region without hal.return" % kernel)

    def host_function(self, block, outputs: int) -> None:
        for k, arg in enumerate(block.arguments):
            type_name = str(arg.type)
            if type_name == "!hal.buffer_view":
                self.views[arg] = k
            else:
                out = self.new(_width(arg.type))
                self.program.append(["read", out, len(self.reads)])
                self.reads.append([k, -1])
                self.ints[arg] = out
        for op in block.operations:
            op = op.operation
            name = op.name
            if self.integer_op(op) or name in _IGNORED:
                continue
            if name == "hal.element_type":
                type_name = str(op.attributes["type"])
                digits = "".join(c for c in type_name if c.isdigit())
                self.element_types[op.results[0]] = max(8, int(digits or 0)) // 8
            elif name == "hal.buffer_view.assert":
                view, element_type, _, *dims = op.operands
                if view in self.views and element_type in self.element_types:
                    self.shapes[self.views[view]] = [self.element_types[element_type],
                                                     [self.int_of(d) for d in dims]]
            elif name == "hal.buffer_view.dim":
                position = self.views[op.operands[0]]
                out = self.new(64)
                self.program.append(["read", out, len(self.reads)])
                self.reads.append([position, _int_attr(op.attributes["index"])])
                self.ints[op.results[0]] = out
            elif name == "stream.tensor.import":
                source = op.operands[0]
                if source not in self.views:
                    raise LaunchUnsupported("import of something other than an argument")
                self.buffers[op.results[0]] = (["arg", self.views[source]], None)
            elif name == "stream.resource.alloca":
                self.buffers[op.results[0]] = (["transient", len(self.transients)], None)
                self.transients.append(self.int_of(op.operands[0]))
            elif name == "stream.timepoint.await":
                count = len(op.results)
                for result, source in zip(op.results, list(op.operands)[:count]):
                    self.buffers[result] = self.buffer_of(source)
            elif name == "stream.resource.subview":
                source, _, offset, _ = op.operands
                self.buffers[op.results[0]] = self.at(source, self.int_of(offset))
            elif name == "util.optimization_barrier":
                # keeps IREE's optimizer from looking through values; nothing to run
                for result, operand in zip(op.results, op.operands):
                    if operand in self.ints:
                        self.ints[result] = self.ints[operand]
                    else:
                        self.buffers[result] = self.buffer_of(operand)
            elif name == "stream.cmd.execute":
                segments = list(_segments(op))
                resources = list(op.operands)[:segments[0]]
                body = op.regions[0].blocks[0]
                for arg, resource in zip(body.arguments, resources):
                    self.buffers[arg] = self.buffer_of(resource)
                self.command_block(body)
            elif name == "stream.tensor.export":
                # (the buffer, value id of its size in bytes)
                self.exports[op.results[0]] = (self.buffer_of(op.operands[0]), self.int_of(op.operands[-1]))
            elif name == "util.return":
                results = list(op.operands)
                if len(results) != outputs:
                    raise LaunchUnsupported("main returns %d values, expected %d" % (len(results), outputs))
                for k, value in enumerate(results):
                    if value not in self.exports:
                        raise LaunchUnsupported("result %d is not an exported buffer" % k)
                    (base, sub), size = self.exports[value]
                    target = ["arg", self.arguments - outputs + k]
                    if base == target and sub is None:
                        continue          # written in place, as pydisc asks with {iree.abi.output = k}
                    # a result IREE left elsewhere (an input, a buffer it allocated, another output):
                    # copied into the output once everything else ran
                    self.commands.append(["copy", base, sub if sub is not None else self.const(0, 64), target,
                                          self.const(0, 64), size])
            else:
                raise LaunchUnsupported("host op %s" % name)

    def command_block(self, block) -> None:
        for op in block.operations:
            op = op.operation
            name = op.name
            if name in _IGNORED_COMMANDS:
                continue
            if name in ("stream.cmd.concurrent", "stream.cmd.serial"):
                # one stream runs a concurrent region's commands in order: a valid serialisation
                self.command_block(op.regions[0].blocks[0])
            elif name == "stream.cmd.dispatch":
                self.dispatch(op)
            elif name == "stream.cmd.copy":
                src, _, src_offset, dst, _, dst_offset, length = op.operands
                self.commands.append(["copy", *self.at(src, self.int_of(src_offset)),
                                      *self.at(dst, self.int_of(dst_offset)), self.int_of(length)])
                self.wrote(self.commands[-1][3])
            elif name == "stream.cmd.fill":
                target, _, offset, length, value = op.operands
                width = _width(value.type)
                if width not in (8, 16, 32):
                    raise LaunchUnsupported("fill with a %d-bit pattern" % width)
                self.commands.append(["fill", *self.at(target, self.int_of(offset)), self.int_of(length),
                                      self.int_of(value), width // 8])
                self.wrote(self.commands[-1][1])
            elif not self.integer_op(op):
                raise LaunchUnsupported("command %s" % name)

    def dispatch(self, op) -> None:
        entry_points = list(op.attributes["entry_points"])
        if len(entry_points) != 1:
            raise LaunchUnsupported("dispatch with %d entry points" % len(entry_points))
        kernel = str(entry_points[0]).rsplit("::", 1)[-1].lstrip("@").strip('"')
        n_work, n_const, n_res, _, n_off, n_len = _segments(op)
        operands = list(op.operands)
        workload = [self.int_of(v) for v in operands[:n_work]]
        constants = operands[n_work:n_work + n_const]
        for value in constants:
            if _width(value.type) != 32:
                raise LaunchUnsupported("push constant of type %s" % value.type)
        start = n_work + n_const
        resources = operands[start:start + n_res]
        offsets = operands[start + 2 * n_res:start + 2 * n_res + n_off]
        lengths = operands[start + 2 * n_res + n_off:start + 2 * n_res + n_off + n_len]
        bindings = [[*self.at(r, self.int_of(o)), self.int_of(n)] for r, o, n in zip(resources, offsets, lengths)]
        accesses = [_int_attr(a) for a in op.attributes["resource_accesses"]]
        for (base, _, _), access in zip(bindings, accesses):
            if access & 2:                          # stream's ResourceAccessBitfield: 1 read, 2 write
                self.wrote(base)
        grid = self.grid(kernel, workload)
        if len(grid) != 3:
            raise LaunchUnsupported("kernel %s: grid of rank %d" % (kernel, len(grid)))
        self.commands.append(["dispatch", kernel, grid, [self.int_of(v) for v in constants], bindings])


def _segments(op) -> list[int]:
    return list(op.attributes["operandSegmentSizes"])


def extract_schedule(host_mlir: bytes | str) -> Schedule:
    """The `Schedule` of `main` in a module compiled with `--compile-to=executable-targets`.

    `main` takes the inputs, then one argument per result that the result is written into
    (`{iree.abi.output = k}`), as pydisc's emitter writes it; anything else is unsupported."""

    with ir.Context() as context:
        module = ir.Module.parse(host_mlir, context)
        main = None
        for top in module.body.operations:
            if top.operation.name == "util.func" and str(top.attributes["sym_name"]).strip('"') == "main":
                main = top
        if main is None:
            raise LaunchUnsupported("no util.func @main in the host code")
        body = main.regions[0].blocks[0]
        returns = [op for op in body.operations if op.operation.name == "util.return"]
        if len(returns) != 1:
            raise LaunchUnsupported("main has %d returns" % len(returns))
        outputs = len(returns[0].operands)
        extractor = _Extractor(len(body.arguments))
        extractor.collect_kernels(module)
        extractor.host_function(body, outputs)
    return Schedule(extractor.arguments, extractor.reads, extractor.shapes, extractor.program, extractor.widths,
                    extractor.transients, extractor.commands, sorted(extractor.written))
