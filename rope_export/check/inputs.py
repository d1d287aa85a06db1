"""Inputs for the comparison: generated from the graph's declared inputs, or the user's own.

Generated inputs are right for a decoder, whatever names and dims the file declares: token ids
below the vocabulary size read from the embedding, position ids that continue the past, attention
masks of ones, past keys/values of the declared shape. Dynamic dims take the case's batch,
sequence and past length (by their names: batch, seq, past, past+seq, ...; else by the input's role
and axis); a static dim is kept and, where it fixes the batch or a length, every case follows it.

The stress cases (``stress_cases``) are the RoPE ones: a prefill, a long sequence, large
activations, decode steps with a past, positions at the middle and at the end of the position
range, on both sides of the RoPE's original context (LongRoPE's and dynamic NTK's switch; each a
decode step whose positions are offset from its short past, so memory stays bounded), past the end
where the file allows it, and (for multimodal RoPE) three different position
rows. Or the user's feeds: ``--inputs feeds.npz`` (one case) or a polygraphy-style data-loader
script ``loader.py[:load_data]`` (a function yielding feed dicts, one case each).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rope_export.check.model_file import CheckError, ModelFile, TensorSpec, require_memory


@dataclass
class Case:
    name: str
    feeds: dict[str, np.ndarray]
    positions: np.ndarray | None  # [B, S] positions of the new tokens (for the error-by-position plot)


@dataclass(frozen=True)
class Sizes:
    batch: int
    seq: int
    past: int


@dataclass
class InputPlan:
    """How the cases are sized: flags, else the file's metadata, else these defaults."""

    batch: int = 2
    seq: int = 16
    past: int = 8
    long_seq: int = 128
    position_limit: int | None = None  # positions [0, limit) are the file's range (cache rows, max positions)
    past_end_allowed: bool = False  # positions >= limit are legal (pass-through, or computed in the graph)
    vocab: int | None = None
    seed: int = 1
    position_inputs: tuple[str, ...] = ()  # inputs the rotary nodes' positions flow from, whatever their names
    # the RoPE's original context (original_max_position_embeddings) when it is inside the range: LongRoPE and
    # dynamic NTK switch there, llama3/YaRN scaling is what carries a model past it
    original_context: int | None = None


def input_role(spec: TensorSpec) -> str:
    name = spec.name.lower()
    if "cache_position" in name:
        return "cache_position"
    if "position" in name:
        return "position_ids"
    if name.endswith("input_ids") or name in ("ids", "tokens"):
        return "input_ids"
    if "mask" in name:
        return "attention_mask"
    if name.startswith("past"):
        return "past"
    return "float" if spec.is_float else "other"


def _by_name(symbol: str, sizes: Sizes) -> int | None:
    s = symbol.lower()
    if "batch" in s:
        return sizes.batch
    if "+" in s or "total" in s:
        return sizes.past + sizes.seq
    if "past" in s:
        return sizes.past
    if "seq" in s or "len" in s:
        return sizes.seq
    return None


def _role_axes(role: str, rank: int) -> dict[int, str]:
    """Which axis of an input of this role holds the batch ("B"), new tokens ("S"), past ("P"), both ("T")."""
    if role == "position_ids" and rank == 3:
        return {1: "B", 2: "S"}
    if role in ("input_ids", "position_ids", "float", "other") and rank >= 2:
        return {0: "B", 1: "S"}
    if role == "attention_mask":
        return {0: "B", 1: "T"}
    if role == "past" and rank == 4:
        return {0: "B", 2: "P"}
    if role == "cache_position":
        return {0: "S"}
    return {}


def _axis_size(code: str, sizes: Sizes) -> int:
    return {"B": sizes.batch, "S": sizes.seq, "P": sizes.past, "T": sizes.past + sizes.seq}[code]


def fit_sizes(specs: list[TensorSpec], sizes: Sizes) -> Sizes:
    """The case's sizes with every static batch / length of the file imposed."""
    fixed = {}
    # token ids and positions first: their axes are surely batch and sequence (X's axis 1 may be heads)
    for spec in sorted(specs, key=lambda s: input_role(s) not in ("input_ids", "position_ids")):
        if input_role(spec) == "float" and len(spec.dims or ()) == 4:  # [B, H, S, D] or [B, S, H, D]: axis 1 unsure
            continue
        for axis, code in _role_axes(input_role(spec), len(spec.dims or ())).items():
            d = spec.dims[axis]
            if isinstance(d, int) and code in "BSP":
                fixed.setdefault(code, d)
    return Sizes(fixed.get("B", sizes.batch), fixed.get("S", sizes.seq), fixed.get("P", sizes.past))


def shape_of(spec: TensorSpec, sizes: Sizes, symbols: dict[str, int]) -> tuple[int, ...]:
    if spec.dims is None:
        raise CheckError(f"input {spec.name!r} has no declared rank, so check cannot make it; pass --inputs feeds.npz")
    role = input_role(spec)
    axes = _role_axes(role, len(spec.dims))
    shape = []
    for axis, d in enumerate(spec.dims):
        if isinstance(d, int):
            shape.append(d)
            continue
        if d is not None and d in symbols:
            shape.append(symbols[d])
            continue
        value = _by_name(d, sizes) if d else None
        if value is None and axis in axes:
            value = _axis_size(axes[axis], sizes)
        if value is None:
            raise CheckError(f"cannot size dim {axis} ({d or '?'}) of input {spec.name!r}: its name and role do not "
                             "say what it is; pass --inputs feeds.npz with your own inputs")
        if d:
            symbols[d] = value
        shape.append(value)
    return tuple(shape)


def make_feeds(specs: list[TensorSpec], sizes: Sizes, first: int, plan: InputPlan, rng: np.random.Generator,
               scale: float = 1.0, varied_rows: bool = False) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """One case's feeds, and the [B, S] positions of its new tokens."""
    symbols: dict[str, int] = {}
    positions = first + np.broadcast_to(np.arange(sizes.seq), (sizes.batch, sizes.seq))
    feeds = {}
    for spec in specs:
        shape = shape_of(spec, sizes, symbols)
        role = plan_role(spec, plan)
        if role == "input_ids":
            value = rng.integers(0, plan.vocab or 2, shape)
        elif role == "position_ids":
            value = _positions(shape, positions, varied_rows)
        elif role == "cache_position":
            value = np.arange(first, first + shape[0])
        elif role == "attention_mask" or spec.dtype == np.bool_:
            value = np.ones(shape)
        elif spec.is_float:
            value = rng.standard_normal(shape, dtype=np.float32) * scale
        else:
            value = np.zeros(shape)
        feeds[spec.name] = np.asarray(value).astype(spec.dtype)
    return feeds, positions


def _positions(shape, positions: np.ndarray, varied_rows: bool) -> np.ndarray:
    if len(shape) == 2:
        return np.broadcast_to(positions, shape).copy()
    if len(shape) == 3:  # multimodal RoPE: (temporal, height, width) rows
        if not varied_rows:
            return np.broadcast_to(positions, shape).copy()
        p = np.broadcast_to(positions, shape[1:])
        rows = [p, p // 2, p % 3 + p // 3][: shape[0]]
        return np.stack(rows + [p] * (shape[0] - len(rows)))
    raise CheckError(f"position ids of rank {len(shape)} are not [B, S] or [3, B, S]; pass --inputs feeds.npz")


# -- the stress cases --------------------------------------------------------------------------

def plan_role(spec: TensorSpec, plan: InputPlan) -> str:
    """An input's role; an input the rotary nodes' positions flow from is a position input, whatever its name."""
    return "position_ids" if spec.name in plan.position_inputs else input_role(spec)


def stress_cases(mf: ModelFile, plan: InputPlan, memory_limit: int) -> tuple[list[Case], list[str]]:
    """The RoPE stress cases for this file's inputs, and notes on the ones left out."""
    specs = mf.inputs
    roles = {plan_role(s, plan) for s in specs}
    has_past = "past" in roles
    position_rank = max((len(s.dims or ()) for s in specs if plan_role(s, plan) == "position_ids"), default=0)
    limit = plan.position_limit
    notes = []
    b, s, p = plan.batch, plan.seq, plan.past if has_past else 0
    if limit is not None:
        s = max(1, min(s, limit))
    specs_ = [  # name, sizes, first position, scale, varied rows
        ("prefill", Sizes(b, s, 0), 0, 1.0, False),
        ("large-magnitude", Sizes(b, s, p), p, 4.0, False),
    ]
    long_seq = plan.long_seq if limit is None else min(plan.long_seq, limit)
    if long_seq > s:
        specs_.append(("long-sequence", Sizes(1, long_seq, 0), 0, 1.0, False))
    if has_past:
        specs_.append(("decode", Sizes(b + 1, 1, p), p, 1.0, False))
    if limit is None:
        notes.append("the file records no position range, so no case runs at its end; give --hf or --reference, "
                     "or export with rope-export")
    elif has_past:
        specs_ += [("decode-mid-positions", Sizes(b + 1, 1, p), limit // 2, 1.0, False),
                   ("decode-end-of-positions", Sizes(b, 1, p), limit - 1, 1.0, False)]
    else:
        tail = min(4, limit)
        specs_.append(("prefill-end-of-positions", Sizes(b, tail, 0), limit - tail, 1.0, False))
    edge = plan.original_context
    if has_past and edge is not None and 0 < edge < (limit or 0) - 1 and limit // 2 != edge:
        # both sides of the original context by a position offset (a past of p tokens, not a long sequence)
        specs_ += [("decode-original-context-end", Sizes(b, 1, p), edge - 1, 1.0, False),
                   ("decode-past-original-context", Sizes(b, 1, p), edge, 1.0, False)]
    if limit is not None and plan.past_end_allowed:
        specs_.append(("past-end-of-positions", Sizes(b, 4, 0), limit - 2, 1.0, False))
    if position_rank == 3:
        specs_.append(("mrope-3d-positions", Sizes(b, s, 0), 0, 1.0, True))
    moved = set()
    if not roles & {"position_ids", "cache_position"}:
        specs_, moved = _positions_from_past(specs_, has_past, notes)
    rng = np.random.default_rng(plan.seed)
    cases = []
    for name, wanted, first, scale, varied in specs_:
        sizes = fit_sizes(specs, wanted)
        if name == "long-sequence" and sizes.seq < wanted.seq and sizes.seq <= s:
            notes.append(f"case long-sequence left out: the file fixes the sequence at {sizes.seq} tokens")
            continue
        if name == "prefill-end-of-positions":  # still ending at the last position with a static length
            first = max(0, limit - sizes.seq)
        need = working_set_bytes(specs, sizes)
        if name in moved and need > memory_limit:
            notes.append(f"case {name} left out: without position_ids it needs a past of {sizes.past} tokens, about "
                         f"{need / 1e9:.1f} GB, more than the memory allowed")
            continue
        require_memory(f"case {name} (batch {sizes.batch}, {sizes.seq} new tokens, past {sizes.past}) with the "
                       "model's activations", need, memory_limit)
        feeds, positions = make_feeds(specs, sizes, first, plan, rng, scale, varied)
        cases.append(Case(name, feeds, positions))
    return cases, notes


def _positions_from_past(specs_: list, has_past: bool, notes: list[str]) -> tuple[list, set[str]]:
    """Cases for a file without position ids (optimum's Gemma exports): its new tokens sit at the past
    length, so a case at position P runs with a past of P tokens; without a past input only cases
    that start at 0 can run. Returns the cases and the names of those whose past was lengthened."""
    kept, moved = [], set()
    for name, sizes, first, scale, varied in specs_:
        if varied:
            continue  # 3-D positions need a position_ids input
        if first != sizes.past:
            if not has_past:
                notes.append(f"case {name} left out: the file has no position_ids or past input, so its tokens "
                             "always start at position 0")
                continue
            sizes, moved = Sizes(sizes.batch, sizes.seq, first), moved | {name}
        kept.append((name, sizes, first, scale, varied))
    if kept:
        notes.append("the file has no position_ids input: its new tokens are numbered from the past length, "
                     "and so are the reference's")
    return kept, moved


ACTIVATION_FACTOR = 32  # a block's intermediate tensors, as a multiple of its inputs (a rough, safe bound)


def working_set_bytes(specs: list[TensorSpec], sizes: Sizes) -> int:
    """About what running one case takes: its inputs, the activations (a multiple of them) and the
    attention scores [B, heads, S, past+S] in float32 (heads: 4x the key/value heads, or 128)."""
    symbols: dict[str, int] = {}
    inputs = sum(int(np.prod(shape_of(s, sizes, symbols))) * s.dtype.itemsize for s in specs)
    kv_heads = [s.dims[1] for s in specs if input_role(s) == "past" and s.dims and isinstance(s.dims[1], int)]
    heads = 4 * max(kv_heads) if kv_heads else 128
    scores = 4 * sizes.batch * heads * sizes.seq * (sizes.past + sizes.seq)
    return ACTIVATION_FACTOR * inputs + 2 * scores


def find_vocab(mf: ModelFile) -> int | None:
    """Rows of the embedding the token ids index: the Gather whose indices are the ids input."""
    ids = {s.name for s in mf.inputs if input_role(s) == "input_ids"}
    casts = {n.output[0]: n.input[0] for n in mf.proto.graph.node if n.op_type in ("Cast", "Identity") and n.input}
    for node in mf.proto.graph.node:
        if node.op_type == "Gather" and len(node.input) == 2 and casts.get(node.input[1], node.input[1]) in ids:
            table = mf.initializer(node.input[0])
            if table is not None and table.dims:
                return int(table.dims[0])
    return None


# -- the user's own inputs ---------------------------------------------------------------------

def user_cases(sources: list[str], mf: ModelFile) -> list[Case]:
    cases = []
    for source in sources:
        for i, feeds in enumerate(_load_feeds(source)):
            check_feeds(feeds, mf.inputs, source)
            name = Path(source.split(":")[0]).name + (f"#{i}" if i else "")
            pos = next((feeds[s.name] for s in mf.inputs if input_role(s) == "position_ids"), None)
            if pos is not None:
                pos = np.asarray(pos)
                pos = pos[0] if pos.ndim == 3 else pos
            cases.append(Case(name, feeds, pos if pos is not None and pos.ndim == 2 else None))
    if not cases:
        raise CheckError(f"--inputs {', '.join(sources)} gave no feeds")
    return cases


def _load_feeds(source: str):
    path_text, _, function = source.partition(":") if source.count(":") == 1 and not Path(source).exists() \
        else (source, "", "")
    path = Path(path_text)
    if not path.is_file():
        raise CheckError(f"--inputs {source}: no such file (give feeds.npz or a data-loader script loader.py)")
    if path.suffix == ".py":
        spec = importlib.util.spec_from_file_location(f"_rope_export_loader_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # noqa: BLE001 - the user's script
            raise CheckError(f"--inputs {source}: the data-loader script failed: {type(exc).__name__}: {exc}") from None
        loader = getattr(module, function or "load_data", None)
        if not callable(loader):
            raise CheckError(f"--inputs {source}: the script has no function {function or 'load_data'}() "
                             "yielding feed dicts (polygraphy's data-loader convention)")
        try:
            items = list(loader())
        except Exception as exc:  # noqa: BLE001
            raise CheckError(f"--inputs {source}: {function or 'load_data'}() failed: {type(exc).__name__}: {exc}") \
                from None
        for item in items:
            if not isinstance(item, dict):
                raise CheckError(f"--inputs {source}: {function or 'load_data'}() must yield dicts of arrays")
            yield {k: np.asarray(v) for k, v in item.items()}
        return
    try:
        with np.load(path, allow_pickle=False) as data:
            yield {k: data[k] for k in data.files}
    except (ValueError, OSError) as exc:
        raise CheckError(f"--inputs {source}: not a NumPy .npz of arrays ({exc})") from None


def check_feeds(feeds: dict[str, np.ndarray], specs: list[TensorSpec], source: str) -> None:
    """Names, dtypes, ranks and static dims as the file declares them; one symbolic dim, one size."""
    want = {s.name: s for s in specs}
    missing, unknown = sorted(set(want) - set(feeds)), sorted(set(feeds) - set(want))
    if missing or unknown:
        raise CheckError(f"--inputs {source}: " + "; ".join(
            ([f"missing input(s) {missing}"] if missing else []) + ([f"the file has no input(s) {unknown}"] if unknown
                                                                     else [])) + f"; the file's inputs: {sorted(want)}")
    symbols: dict[str, int] = {}
    for name, spec in want.items():
        value = feeds[name]
        declared = f"{spec.type_name} {list(spec.dims) if spec.dims is not None else '[?]'}"
        problem = ""
        if value.dtype != spec.dtype:
            problem = f"is {value.dtype} {list(value.shape)}"
        elif spec.dims is not None and value.ndim != len(spec.dims):
            problem = f"has rank {value.ndim} {list(value.shape)}"
        else:
            for axis, d in enumerate(spec.dims or ()):
                size = value.shape[axis]
                if isinstance(d, int) and d != size:
                    problem = f"has shape {list(value.shape)} (dim {axis} must be {d})"
                elif isinstance(d, str) and symbols.setdefault(d, size) != size:
                    problem = f"has shape {list(value.shape)} (dim {axis} is {d!r}, {symbols[d]} in another input)"
                if problem:
                    break
        if problem:
            raise CheckError(f"--inputs {source}: input {name!r} {problem}; the file declares {declared}")


def describe_plan(plan: InputPlan) -> str:
    parts = [f"batch {plan.batch}", f"seq {plan.seq}", f"past {plan.past}", f"long sequence {plan.long_seq}"]
    if plan.position_limit is not None:
        parts.append(f"positions [0, {plan.position_limit})" + (" and past the end" if plan.past_end_allowed else ""))
    if plan.vocab is not None:
        parts.append(f"token ids < {plan.vocab}")
    return ", ".join(parts)


