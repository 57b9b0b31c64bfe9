"""Regexes of guides read as ECMA-262 (JavaScript, with the u flag: matched over code points), the dialect
of JSON Schema's `pattern`, rewritten into the Rust regex syntax llguidance compiles.

    ecma_to_rust(pattern)   the Rust regex that matches what `pattern` matches in ECMA-262
    ecma_schema(schema)     a copy of a JSON schema with every `pattern` and `patternProperties` key rewritten

One meaning everywhere: a guide's regex (structured_outputs.regex, guided_decoding_guide_type regex) and
the patterns of a JSON schema (response_format, structured_outputs.json, tool parameters) all read `\\d`
as [0-9], `\\w` as [0-9A-Za-z_], `\\s` as ECMA's white space and line terminators, `.` as any code point
but a line terminator, inside character classes too (`[\\d.]`).

Why not a library: llguidance reads a regex guide as Rust's regex crate does, where `\\d` is every Unicode
decimal digit (U+1FBF8 SEGMENTED DIGIT EIGHT among them) and `\\s` Unicode's White_Space (U+0085 in, U+FEFF
out). Its `(?-u)` flag makes `\\d` ASCII but also refuses `.` and negated classes, which could match a
lone byte of UTF-8. Its regex_to_lark(rx, "dw") (what its JSON schema `pattern`s get) rewrites \\d and \\w
but leaves \\s and `.` Unicode's, and its "s" option is Python 2's six ASCII blanks, not ECMA's set.

What Rust and ECMA-262 both read, the same way (literals, groups, alternation, quantifiers, anchors,
\\x/\\u escapes, \\p{...}), passes as it is; \\cX and \\0 become \\x escapes; what llguidance lacks
(lookaround, backreferences, \\b) stays, so it is refused with llguidance's error rather than matching
something else.
"""

from __future__ import annotations

from typing import Any

# ECMA-262's WhiteSpace and LineTerminator code points: what \s matches there
_ECMA_SPACE = r"\t\n\x0B\x0C\r \xA0\u1680\u2000-\u200A\u2028\u2029\u202F\u205F\u3000\uFEFF"
_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_", "s": _ECMA_SPACE}
_DOT = r"[^\n\r\u2028\u2029]"  # ECMA's `.` without the s flag: anything but a line terminator
_ANY = r"[\x00-\x{10FFFF}]"  # ECMA's [^]: any code point
# Inside a class Rust reads `[` as a nested class and `&&`, `--`, `~~` as set operations; ECMA (without
# the v flag) reads them as the characters themselves
_CLASS_LITERALS = "[&~"


class RegexError(ValueError):
    """An ECMA-262 pattern with no Rust equivalent here."""


def _class_escape(letter: str) -> str:
    return f"[{'^' if letter.isupper() else ''}{_CLASSES[letter.lower()]}]"


def ecma_to_rust(pattern: str) -> str:
    """`pattern` (ECMA-262, u flag) in Rust regex syntax with the same meaning."""
    out: list[str] = []
    i, n = 0, len(pattern)
    in_class = False
    class_items = 0  # items written since the class opened (a `-` first or last is a literal)
    after_set = False  # the last class item was a class escape: a `-` after it is a literal (Annex B)
    while i < n:
        c = pattern[i]
        if c == "\\":
            if i + 1 == n:
                raise RegexError(f"regex {pattern!r}: ends in a lone backslash")
            e = pattern[i + 1]
            i += 2
            if e.lower() in _CLASSES:
                if in_class and class_items > 1 and out[-1] == "-":  # [a-\d]: a, '-' and the digits
                    out[-1] = "\\-"
                out.append(_class_escape(e))
                after_set = in_class
            elif e == "b" and in_class:  # [\b] is a backspace in ECMA
                out.append(r"\x08")
                after_set = False
            elif e == "c" and pattern[i:i + 1].isascii() and pattern[i:i + 1].isalpha():  # \cJ: control-J
                out.append(f"\\x{ord(pattern[i]) % 32:02X}")
                i += 1
                after_set = False
            elif e == "0" and not pattern[i:i + 1].isdigit():  # \0: NUL (Rust reads no octal)
                out.append(r"\x00")
                after_set = False
            else:  # \\, \., \u0041, \p{L}, \n ...: the same in both; \b, \B, \1 refused by llguidance
                out.append("\\" + e)
                after_set = False
            class_items += in_class
            continue
        i += 1
        if not in_class:
            if c == "[":
                negated = pattern.startswith("^", i)
                i += negated
                if pattern.startswith("]", i):  # ECMA's [] matches nothing, [^] anything
                    if not negated:
                        raise RegexError(f"regex {pattern!r}: the empty class [] matches nothing")
                    out.append(_ANY)
                    i += 1
                    continue
                out.append("[^" if negated else "[")
                in_class, class_items, after_set = True, 0, False
            else:
                out.append(_DOT if c == "." else c)
            continue
        if c == "]":
            in_class = False
            out.append(c)
        elif c in _CLASS_LITERALS:
            out.append("\\" + c)
            class_items += 1
        elif c == "-" and after_set and not pattern.startswith("]", i):  # [\d-z]: the digits, '-' and z
            out.append("\\-")
            class_items += 1
        else:
            out.append(c)
            class_items += 1
        after_set = False
    if in_class:
        raise RegexError(f"regex {pattern!r}: a character class is not closed")
    return "".join(out)


# JSON Schema's keywords whose values are schemas, maps of schemas, or lists of schemas (draft 4 to 2020-12)
_SCHEMA = ("additionalProperties", "additionalItems", "items", "contains", "propertyNames", "not", "if", "then",
           "else", "unevaluatedItems", "unevaluatedProperties", "contentSchema")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas", "dependencies")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


def ecma_schema(schema: Any) -> Any:
    """A copy of `schema` with each `pattern` and `patternProperties` key in Rust syntax (ecma_to_rust).
    Only schema positions are read: a `const`, `enum`, `default` or `examples` value is data, kept as it is."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, value in schema.items():
        if key == "pattern" and isinstance(value, str):
            out[key] = ecma_to_rust(value)
        elif key == "patternProperties" and isinstance(value, dict):
            out[key] = {ecma_to_rust(k): ecma_schema(v) for k, v in value.items()}
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: ecma_schema(v) for k, v in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [ecma_schema(v) for v in value]
        elif key in _SCHEMA:
            out[key] = ecma_schema(value)
    return out
