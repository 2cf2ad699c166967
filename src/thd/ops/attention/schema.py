"""The flat argument lists of the custom ops ``thd::attention_fwd`` / ``thd::attention_bwd``,
generated once from the fields of :class:`VarlenLayout` and :class:`AttentionOptions`.

A custom op takes only tensors and scalars, so a call's typed objects travel flattened: the op's
schema string, :func:`flatten` and :func:`unflatten` all come from the dataclass fields (their
order and their annotations), so a new field needs no edit here.
"""

from __future__ import annotations

from dataclasses import fields

from thd.ops.attention.params import AttentionOptions, VarlenLayout

__all__ = ["BWD_SCHEMA", "FLAT_NAMES", "FWD_SCHEMA", "flatten", "unflatten"]

# Annotation (as written in params.py) -> custom-op schema type.
_SCHEMA_TYPES = {
    "Tensor": "Tensor",
    "Tensor | None": "Tensor?",
    "int": "int",
    "int | None": "int?",
    "float": "float",
    "bool": "bool",
    "tuple[int, int]": "int[]",
}


def _schema_args(cls: type) -> list[tuple[str, str]]:
    """``(name, schema type)`` of each field of ``cls``, in field order."""
    pairs = []
    for f in fields(cls):
        kind = _SCHEMA_TYPES.get(str(f.type))
        if kind is None:
            raise TypeError(f"{cls.__name__}.{f.name}: no custom-op type for annotation {f.type!r}")
        pairs.append((f.name, kind))
    return pairs


_LAYOUT = _schema_args(VarlenLayout)
_OPTIONS = _schema_args(AttentionOptions)
FLAT_NAMES = tuple(name for name, _ in _LAYOUT + _OPTIONS)
"""The flattened layout and options, in the order the ops take them after their tensors."""
_NUM_LAYOUT = len(_LAYOUT)
_TUPLES = tuple(i for i, (_, kind) in enumerate(_OPTIONS) if kind.endswith("[]"))


def _schema(tensors: str, returns: str) -> str:
    flat = ", ".join(f"{kind} {name}" for name, kind in _LAYOUT + _OPTIONS)
    return f"({tensors}, {flat}) -> ({returns})"


FWD_SCHEMA = _schema("Tensor q, Tensor k, Tensor v, Tensor? sinks", "Tensor, Tensor")
BWD_SCHEMA = _schema(
    "Tensor do, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? sinks",
    "Tensor, Tensor, Tensor, Tensor",
)

_LAYOUT_NAMES = tuple(name for name, _ in _LAYOUT)
_OPTIONS_NAMES = tuple(name for name, _ in _OPTIONS)


def flatten(layout: VarlenLayout, options: AttentionOptions) -> tuple:
    """The layout's and the options' fields, in :data:`FLAT_NAMES` order (plain ``getattr``s, which
    ``torch.compile`` traces)."""
    return (
        *(getattr(layout, name) for name in _LAYOUT_NAMES),
        *(getattr(options, name) for name in _OPTIONS_NAMES),
    )


def unflatten(flat: tuple | list) -> tuple[VarlenLayout, AttentionOptions]:
    """The objects :func:`flatten` came from (list-typed fields back to tuples). Positional, in the
    dataclasses' own field order, as :func:`flatten` wrote them."""
    layout = VarlenLayout(*flat[:_NUM_LAYOUT])
    values = list(flat[_NUM_LAYOUT:])
    for i in _TUPLES:
        values[i] = tuple(values[i])
    return layout, AttentionOptions(*values)
