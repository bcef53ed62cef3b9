"""Spec strings -> codecs: a tiny recursive-descent parser (grammar in docs/codecs.md).

    spec  = call ;
    call  = name [ "(" [ arg { "," arg } ] ")" ] ;
    arg   = call | number | name "=" value ;
    value = number | call ;

A positional argument that is a codec (a `call`) is the inner codec and must come first:
`fp16(svd(0.6))`, `int8(lowrank(0.2), block=64)`. Numbers fill the codec's parameters in order
(`svd(0.6)`, `int8(128)`); `key=value` names them (`int8(block=128, scale=fp32)`). A value that is
a bare name is a word (`scale=fp32`) or, for a codec-typed parameter, a codec; a value with
arguments is a codec (`delta(int8(lowrank(0.1)), first=int8(lowrank(0.25)))`). Everything
invalid raises ConfigError saying where and what.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from nebula.codecs.base import CODECS, Codec
from nebula.codecs.chain import Chain
from nebula.errors import ConfigError

MAX_SPEC_CHARS = 256
MAX_DEPTH = 8
WHITESPACE = " \t\r\n\f\v"  # the grammar's (§3.1), TOKEN's \s; str.strip() would also take '\x1c' or '\u3000'
_ONLY_ASCII_SPACE = " (only space, tab, CR, LF, FF and VT may separate tokens)"
TOKEN = re.compile(r"\s*(?:(?P<num>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"
                   r"|(?P<name>[A-Za-z_]\w*)|(?P<sym>[(),=]))", re.ASCII)


@dataclass
class _Call:
    name: str
    args: list[int | float]  # the numbers, after the inner codec if there is one
    kwargs: dict[str, _Call | int | float | _Bare]
    at: int
    inner: _Call | None = None  # the inner codec: the first argument, if it is a codec


class _Bare(str):
    """A bare name given as a parameter's value (a string, or a codec without arguments), and its column."""

    at: int

    def __new__(cls, name: str, at: int) -> _Bare:
        value = super().__new__(cls, name)
        value.at = at
        return value


class _Parser:
    def __init__(self, text: str):
        self.text, self.tokens, self.i = text, _tokenize(text), 0

    def fail(self, message: str, at: int | None = None) -> ConfigError:
        at = self.tokens[self.i][2] if at is None else at
        return ConfigError(f"codec spec {self.text!r}: {message} at column {at + 1}")

    def peek(self) -> tuple[str, str, int]:
        return self.tokens[self.i]

    def take(self, kind: str, value: str | None = None) -> tuple[str, str, int]:
        token = self.tokens[self.i]
        if token[0] != kind or (value is not None and token[1] != value):
            want = repr(value) if value else {"name": "a codec name", "num": "a number"}.get(kind, kind)
            raise self.fail(f"expected {want}, found {_describe(token)}")
        self.i += 1
        return token

    def call(self, depth: int) -> _Call:
        if depth > MAX_DEPTH:
            raise self.fail(f"codecs nested deeper than {MAX_DEPTH}")
        _, name, at = self.take("name")
        node = _Call(name, [], {}, at)
        if self.peek()[:2] == ("sym", "("):
            self.i += 1
            if self.peek()[:2] != ("sym", ")"):
                self.arg(node, depth)
                while self.peek()[:2] == ("sym", ","):
                    self.i += 1
                    self.arg(node, depth)
            self.take("sym", ")")
        return node

    def arg(self, node: _Call, depth: int) -> None:
        kind, text, at = self.peek()
        if kind == "num":
            self.i += 1
            node.args.append(_number(text))
        elif kind == "name" and self.tokens[self.i + 1][:2] == ("sym", "="):
            self.i += 2
            if text in node.kwargs:
                raise self.fail(f"parameter {text!r} given twice", at)
            vkind, value, value_at = self.peek()
            if vkind not in ("num", "name"):
                raise self.fail(f"expected a value for {text!r}, found {_describe(self.peek())}")
            if vkind == "name" and self.tokens[self.i + 1][:2] == ("sym", "("):
                node.kwargs[text] = self.call(depth + 1)  # a codec with arguments
                return
            self.i += 1
            node.kwargs[text] = _number(value) if vkind == "num" else _Bare(value, value_at)
        elif kind == "name":
            if node.inner is not None or node.args or node.kwargs:  # §3.1: the inner codec MUST be the first argument
                raise self.fail(_misplaced_inner(node, text), at)
            node.inner = self.call(depth + 1)
        else:
            raise self.fail(f"expected an argument, found {_describe(self.peek())}")


def _misplaced_inner(node: _Call, name: str) -> str:
    if node.inner is not None:
        return f"{node.name!r} takes one inner codec, found a second one, {name!r},"
    return (f"the inner codec must be the first argument, e.g. int8(lowrank(0.2), block=64): move {name!r} "
            "before the others; found it")


def parse(spec: str) -> Codec:
    """Spec string -> codec, or ConfigError naming the problem. `parse(s).spec` is canonical."""
    if not isinstance(spec, str):
        raise ConfigError(f"codec spec must be a string, got {type(spec).__name__}")
    if len(spec) > MAX_SPEC_CHARS:
        raise ConfigError(f"codec spec is {len(spec)} characters, the limit is {MAX_SPEC_CHARS}")
    parser = _Parser(spec)
    tree = parser.call(0)
    if parser.peek()[0] != "end":
        raise parser.fail(f"unexpected {_describe(parser.peek())} after the codec")
    _delta_outermost(spec, tree, top=True)
    return _build(spec, tree)


def _delta_outermost(text: str, node: _Call, top: bool) -> None:
    """`delta` keeps per-example rows at both ends: only the outermost codec may be it."""
    if node.name == "delta" and not top:
        raise ConfigError(f"codec spec {text!r}: 'delta' at column {node.at + 1} must be the outermost codec, "
                          "e.g. delta(int8(lowrank(0.5)))")
    for arg in [node.inner, *node.kwargs.values()]:
        if isinstance(arg, _Call):
            _delta_outermost(text, arg, top=False)


def canonical(spec: str) -> str:
    """The normal form of a spec: defaults dropped, required parameters positional, no spaces."""
    return parse(spec).spec


def _build(text: str, node: _Call) -> Codec:
    where = f"codec spec {text!r}, {node.name!r} at column {node.at + 1}"
    cls = CODECS.get(node.name)
    if cls is None:
        raise ConfigError(f"{where}: unknown codec (known: {', '.join(sorted(CODECS))})")
    inner, numbers = node.inner, node.args
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]  # codecs built from specs are dataclasses
    inner_field = next((f for f in fields if f.type in ("Codec", Codec)), None)
    params = [f for f in fields if f is not inner_field]
    kwargs: dict[str, Any] = {}
    if len(numbers) > len(params):
        raise ConfigError(f"{where}: takes at most {len(params)} positional parameters "
                          f"({', '.join(f.name for f in params) or 'none'}), got {len(numbers)}")
    for f, value in zip(params, numbers):
        kwargs[f.name] = value
    for key, given in node.kwargs.items():
        if not any(f.name == key for f in params):
            raise ConfigError(f"{where}: unknown parameter {key!r} "
                              f"(parameters: {', '.join(f.name for f in params) or 'none'})")
        if key in kwargs:
            raise ConfigError(f"{where}: parameter {key!r} given both by position and by name")
        kwargs[key] = given
    for f in params:
        if f.name in kwargs and _codec_typed(f):
            kwargs[f.name] = _codec_value(text, where, f, kwargs[f.name])
        elif f.name in kwargs:
            kwargs[f.name] = _convert(where, f, kwargs[f.name])
        elif f.default is dataclasses.MISSING:
            raise ConfigError(f"{where}: missing parameter {f.name!r}, e.g. {node.name}(0.2)")
    if inner_field is not None:
        if inner is None:
            raise ConfigError(f"{where}: needs an inner codec, e.g. {node.name}(topk(0.01))")
        kwargs[inner_field.name] = _build(text, inner)
        return cls(**kwargs)
    codec = cls(**kwargs)
    return Chain(codec, _build(text, inner)) if inner is not None else codec


def _codec_typed(f: dataclasses.Field) -> bool:
    """An optional codec parameter besides the inner one, e.g. delta's `first`."""
    return f.type in ("Codec | None", "Optional[Codec]")


def _codec_value(text: str, where: str, f: dataclasses.Field, value: Any) -> Codec:
    if isinstance(value, _Bare):  # a bare name: a codec without arguments, `first=int8`
        value = _Call(str(value), [], {}, value.at)
    if not isinstance(value, _Call):
        raise ConfigError(f"{where}: parameter {f.name!r} must be a codec such as int8(lowrank(0.25)), got {value!r}")
    return _build(text, value)


def _convert(where: str, f: dataclasses.Field, value: Any) -> Any:
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    kind = kind.removesuffix(" | None")  # an optional number (delta's `ram`): None is its default, never written
    if isinstance(value, _Call):
        raise ConfigError(f"{where}: parameter {f.name!r} must be {_KIND_WORDS.get(kind, kind)}, got the codec "
                          f"{value.name!r}")
    if kind == "float" and type(value) in (int, float):
        return float(value)
    if kind == "int" and type(value) is int:
        return value
    if kind == "str" and isinstance(value, str):
        return str(value)
    if kind == "bool" and value in ("true", "false"):
        return value == "true"
    raise ConfigError(f"{where}: parameter {f.name!r} must be {_KIND_WORDS.get(kind, kind)}, got {value!r}")


_KIND_WORDS = {"float": "a number", "int": "an integer", "str": "a name", "bool": "true or false"}


def _number(text: str) -> int | float:
    if re.fullmatch(r"[-+]?\d+", text):
        return int(text)
    return float(text)


def _tokenize(text: str) -> list[tuple[str, str, int]]:
    tokens, pos = [], 0
    while pos < len(text):
        match = TOKEN.match(text, pos)
        if match is None:
            if text[pos:].strip(WHITESPACE) == "":
                break
            bad = len(text) - len(text[pos:].lstrip(WHITESPACE))
            raise ConfigError(f"codec spec {text!r}: unexpected character {text[bad]!r} at column {bad + 1}"
                              + _ONLY_ASCII_SPACE * text[bad].isspace())
        kind = match.lastgroup or "sym"
        tokens.append((kind, match.group(kind), match.start(kind)))
        pos = match.end()
    tokens.append(("end", "", len(text)))
    tokens.append(("end", "", len(text)))  # one look-ahead past the end, for `name =`
    return tokens


def _describe(token: tuple[str, str, int]) -> str:
    return "the end of the spec" if token[0] == "end" else repr(token[1])
