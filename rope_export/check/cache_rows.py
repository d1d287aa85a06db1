"""Proving every cache row the file carries, cheaply.

Two parts:

* ``check_tables``: every stored cos/sin table (the ``[rows, rd/2]`` initializers a rotary node
  reads, or, in a file lowered to plain ops, those a Gather reads) is compared row by row with the
  caches its RoPE configuration implies (``rope_types.build_caches``). Without a configuration,
  with the rotation table fitted to it (row p = scale * (cos p*theta, sin p*theta) per channel):
  a changed row is not a rotation of its neighbours.
* ``sweep``: each rotary node, cut out with what computes its caches (``graph.rotary_slices``), is
  run alone on every runner over positions covering every row (plus out-of-range ones where the
  file passes them through), in chunks of bounded size, and compared with the configuration's
  rotation (float64 caches, the contract's reference op); without a configuration, with the file's
  own tables, or else with onnx-reference (the golden).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rope_export.check.compare import PositionErrors, describe_ranges, limit_ratio, row_ranges
from rope_export.check.graph import CONTRACT_KINDS, RotarySlice, tables_by_shape
from rope_export.check.inputs import InputPlan, Sizes, make_feeds
from rope_export.check.model_file import ModelFile
from rope_export.check.runners import Limits, Skip, first_line, make_runner
from rope_export.op.rope_types import RopeConfig, build_caches, inv_freq_and_scaling
from rope_export.op.tolerances import tolerance

CHUNK_ELEMENTS = 1 << 22  # X elements per run of a node alone (16 MB in float32)
FLOAT32_ANGLE_SLACK = 2.0**-22  # caches computed in the graph in float32: angle error ~p*theta*2^-24 per rounding
HALF_CACHE_SLACK = {"float16": 2.0**-10, "bfloat16": 2.0**-7}  # cos/sin rounded to X's half type
PEER_SWEEP = 4096  # positions the runners are compared over when the file records no range
OUT_OF_RANGE = (-1, -7)  # swept where the file passes them through, with limit, limit + 1 and 2 * limit + 5


@dataclass
class TableCheck:
    name: str
    role: str  # "cos" or "sin"
    rows: int
    against: str  # "the RoPE configuration" or "a fitted rotation table"
    max_abs: float
    bad_rows: list[tuple[int, int]]
    passed: bool
    problem: str = ""

    def message(self) -> str:
        if self.problem:
            return f"{self.role} cache {self.name!r}: {self.problem}"
        return (f"{self.role} cache {self.name!r} rows {describe_ranges(self.bad_rows)} differ from "
                f"{self.against} (max abs {self.max_abs:.3g})")


def _dtype_name(array: np.ndarray) -> str:
    return "float32" if array.dtype == np.float32 else str(array.dtype)


def _bad_rows(actual: np.ndarray, expected: np.ndarray, tol, slack=0.0) -> tuple[float, list]:
    err = np.abs(actual - expected)
    allowed = tol.atol + tol.rtol * np.abs(expected) + slack
    bad = np.nonzero((err > allowed).any(axis=1) | ~np.isfinite(actual).all(axis=1))[0]
    return float(np.nan_to_num(err, nan=np.inf).max(initial=0.0)), row_ranges(bad)


def _wrap(angle):
    return (angle + np.pi) % (2 * np.pi) - np.pi


def fitted_rotation(cos: np.ndarray, sin: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rotation table nearest to most rows of (cos, sin): per channel a scale and an angle per row.

    Robust to a minority of changed rows: the angle step is a median, refined by least squares over
    the rows that agree with it."""
    rows = np.arange(cos.shape[0], dtype=np.float64)[:, None]
    phase, scale = np.arctan2(sin, cos), np.median(np.hypot(cos, sin), axis=0)
    step = np.median(_wrap(np.diff(phase, axis=0)), axis=0) if len(cos) > 1 else np.zeros(cos.shape[1])
    guided = rows * step + _wrap(phase - rows * step)  # unwrapped along the first estimate
    theta = np.median(guided[1:] / rows[1:], axis=0) if len(cos) > 1 else step
    inliers = np.abs(_wrap(phase - rows * theta)) < 1e-3
    theta = (rows * guided * inliers).sum(axis=0) / np.maximum((rows**2 * inliers).sum(axis=0), 1.0)
    return scale * np.cos(rows * theta), scale * np.sin(rows * theta), np.abs(theta)


def check_tables(mf: ModelFile, rope: RopeConfig | None, slices: list[RotarySlice],
                 position_limit: int | None, ropes: list[RopeConfig | None] | None = None) -> list[TableCheck]:
    """``rope``: the file's configuration; ``ropes``: each slice's where layers differ (None: ``rope`` for all)."""
    ropes = [rope] * len(slices) if ropes is None else ropes
    pairs = {(s.tables["cos"], s.tables["sin"]): r for s, r in zip(slices, ropes, strict=True) if s.tables}
    results, fitted = [], []
    for (cos_name, sin_name), r in sorted(pairs.items(), key=lambda item: item[0]):
        if r is not None and not r.seq_len_dependent:
            results += [_against_configuration(mf, r, n, role) for role, n in (("cos", cos_name), ("sin", sin_name))]
        else:
            fitted.append((cos_name, sin_name))
    if not pairs and rope is not None and not rope.seq_len_dependent and position_limit:
        # lowered to plain ops: the tables are what a Gather reads
        for name in tables_by_shape(mf, position_limit, rope.rotary_embedding_dim // 2):
            results.append(_against_configuration(mf, rope, name, None))
    for name in sorted({s.table for s in slices if not s.tables and s.table and _complex_table(mf, s.table)}):
        fitted.append((name, name))  # Meta's freqs_cis as [rows, rd/2, 2]: (cos, sin) per pair
    for cos_name, sin_name in fitted:
        if cos_name == sin_name:
            table = mf.tensor(cos_name).astype(np.float64)
            table = table.reshape(-1, table.shape[-2], 2)
            cos, sin = table[..., 0], table[..., 1]
        else:
            cos, sin = mf.tensor(cos_name).astype(np.float64), mf.tensor(sin_name).astype(np.float64)
        want_cos, want_sin, theta = fitted_rotation(cos, sin)
        tol = tolerance("op", _dtype_name(mf.tensor(cos_name)))
        slack = np.arange(len(cos))[:, None] * theta * FLOAT32_ANGLE_SLACK  # tables made in float32 elsewhere
        # one check for the pair: a changed cos or sin row is a row that is no rotation of its neighbours
        worst, bad = _bad_rows(np.concatenate([cos, sin], axis=1), np.concatenate([want_cos, want_sin], axis=1), tol,
                               np.concatenate([slack, slack], axis=1))
        results.append(TableCheck(cos_name if cos_name == sin_name else f"{cos_name}, {sin_name}", "cos/sin",
                                  len(cos), "a fitted rotation table", worst, bad, not bad))
    return results


def _complex_table(mf: ModelFile, name: str) -> bool:
    """A [rows, w, 2] float table (a complex freqs_cis seen as real): each row (cos, sin) per channel pair."""
    dims = [d for d in mf.initializer(name).dims]
    while len(dims) > 3 and dims[0] == 1:
        dims = dims[1:]
    return len(dims) == 3 and dims[2] == 2 and dims[0] > 1


def _against_configuration(mf: ModelFile, rope: RopeConfig, name: str, role: str | None) -> TableCheck:
    raw = mf.tensor(name)
    table = raw.astype(np.float64)
    half = rope.rotary_embedding_dim // 2
    if table.ndim != 2 or table.shape[1] != half:
        return TableCheck(name, role or "cos/sin", len(table), "the RoPE configuration", float("inf"), [], False,
                          f"is {list(table.shape)} but the RoPE configuration rotates {2 * half} channels "
                          f"([rows, {half}])")
    cos, sin = (t.double().numpy() for t in build_caches(rope, table.shape[0]))
    tol = tolerance("op", _dtype_name(raw))
    if role is None:  # found by shape: whichever most of its rows match
        agree = {r: int((np.abs(table - t) <= tol.atol + tol.rtol * np.abs(t)).all(axis=1).sum())
                 for r, t in (("cos", cos), ("sin", sin))}
        role = max(agree, key=agree.get)
    worst, bad = _bad_rows(table, cos if role == "cos" else sin, tol)
    return TableCheck(name, role, len(table), "the RoPE configuration", worst, bad, not bad)


# -- the sweep ---------------------------------------------------------------------------------

@dataclass
class SweepResult:
    runner: str
    status: str = "skipped"  # "pass", "FAIL", "skipped", or "golden" (the reference of a sweep)
    reason: str = ""
    max_abs: float | None = None
    positions: int = 0
    out_of_range: int = 0
    slices: int = 0
    failures: list[str] = field(default_factory=list)
    position_error: PositionErrors = field(default_factory=PositionErrors)

    def fail(self, message: str) -> None:
        self.failures.append(message)

    def finish(self) -> None:
        if self.status == "golden":
            return
        if self.failures:
            self.status, self.reason = "FAIL", "; ".join(self.failures[:3])
        elif self.slices:
            self.status, self.reason = "pass", ""


@dataclass
class _Golden:
    """What a slice's output should be: the configuration's rotation, the file's tables, or a runner."""

    kind: str  # "configuration", "tables" or "runner"
    rope: RopeConfig | None = None
    tables: tuple | None = None
    limit: int | None = None
    runner: object = None
    slack_per_position: float = 0.0  # times max|x|: caches computed in the graph in float32
    slack: float = 0.0  # times max|x|: caches rounded to a half type
    from_table: bool = False  # the limit is the rows of the table per-token caches are cut from


def _per_token(value: np.ndarray, rank: int) -> np.ndarray:
    """[1, H, S, D] or [1, S, H*D] -> [S, channels]."""
    value = np.asarray(value, np.float64)
    return (value[0].transpose(1, 0, 2).reshape(value.shape[2], -1) if rank == 4 else value[0])


def _rotate(golden: _Golden, sl: RotarySlice, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    import torch

    from rope_export.op.reference import rotary_embedding
    from rope_export.runtimes.contract_runners import to_torch

    rn = sl.chosen
    xt = to_torch(x)
    rank = x.ndim
    head_dim = x.shape[3] if rank == 4 else x.shape[2] // rn.num_heads
    if golden.kind == "tables":
        cos, sin = golden.tables
        interleaved, rotary_dim, pos = bool(rn.interleaved), sl.rotary_dim, torch.from_numpy(positions)
    else:
        rope = golden.rope
        interleaved, rotary_dim = rope.interleaved, rope.rotary_embedding_dim
        p = positions.astype(np.float64)[..., None]
        if rope.seq_len_dependent:
            inv_freq, scaling = inv_freq_and_scaling(rope, int(positions.max()) + 1)
        else:
            inv_freq, scaling = inv_freq_and_scaling(rope)
        angles = p * inv_freq.double().numpy()
        cos, sin = np.cos(angles) * scaling, np.sin(angles) * scaling
        if golden.limit is not None and not rope.seq_len_dependent:  # stored tables: out-of-range passes through
            outside = ((positions < 0) | (positions >= golden.limit))[..., None]
            cos, sin = np.where(outside, 1.0, cos), np.where(outside, 0.0, sin)
        cos, sin, pos = torch.from_numpy(cos).float(), torch.from_numpy(sin).float(), None
    y = rotary_embedding(xt, cos, sin, pos, interleaved=interleaved, num_heads=rn.num_heads if rank == 3 else 0,
                         rotary_embedding_dim=0 if rotary_dim == head_dim else rotary_dim)
    return _per_token(y.float().numpy(), rank)


def _chunks(limit: int, width: int, out_of_range: bool, fixed: int | None = None) -> list[np.ndarray]:
    """Positions covering [0, limit) in runs of bounded size; ``fixed``: every run exactly that long (the
    file's static sequence length; the last run ends at limit - 1)."""
    if fixed:
        chunks = [np.arange(start, start + fixed) for start in (*range(0, limit - fixed, fixed), limit - fixed)]
    else:
        size = max(1, min(limit, CHUNK_ELEMENTS // max(width, 1)))
        chunks = [np.arange(start, min(start + size, limit)) for start in range(0, limit, size)]
    if out_of_range:
        outside = np.array([*OUT_OF_RANGE, limit, limit + 1, 2 * limit + 5])
        chunks.append(np.resize(outside, fixed) if fixed else outside)
    return chunks


def _static(dim) -> int | None:
    return dim if isinstance(dim, int) and dim > 0 else None


def _fixed_seq(sl: RotarySlice) -> int | None:
    """The sequence length the file fixes for this node (X's, or its positions'), or None when dynamic."""
    dims = sl.x.dims
    fixed = _static(dims[2] if len(dims) == 4 else dims[1])
    for spec in sl.position_inputs:
        if fixed is None and spec.dims and len(spec.dims) >= 2:
            fixed = _static(spec.dims[-1])
    return fixed


def _slice_feeds(sl: RotarySlice, positions: np.ndarray, rng) -> dict[str, np.ndarray]:
    s = len(positions)
    batch = _static(sl.x.dims[0]) or 1
    feeds, _ = make_feeds(sl.graph_inputs, Sizes(batch, s, 0), int(positions[0]), InputPlan(vocab=2), rng)
    for spec in sl.position_inputs:  # found by data flow, whatever the input is called
        shape = feeds[spec.name].shape
        value = np.broadcast_to(positions, shape) if shape and shape[-1] == s else np.full(shape, positions[0])
        feeds[spec.name] = value.astype(spec.dtype)
    dims = sl.x.dims
    shape = (batch, dims[1], s, dims[3]) if len(dims) == 4 else (batch, s, dims[2])
    feeds[sl.x.name] = rng.standard_normal(shape, dtype=np.float32).astype(sl.x.dtype)
    return feeds


class _PositionsRead:
    """The positions the node reads where the graph computes them (start_pos + arange, arange over the
    sequence, ...): the nodes between the inputs and the node, evaluated by onnx.reference."""

    def __init__(self, sl: RotarySlice):
        self.evaluator = None
        if sl.positions_model is not None:
            from onnx.reference import ReferenceEvaluator

            self.evaluator = ReferenceEvaluator(sl.positions_model)
            self.names = [i.name for i in sl.positions_model.graph.input]

    def __call__(self, feeds: dict[str, np.ndarray], fed: np.ndarray) -> np.ndarray:
        if self.evaluator is None:
            return fed
        (value,) = self.evaluator.run(None, {n: feeds[n] for n in self.names})
        value = np.asarray(value, np.int64)
        return value.reshape(-1, value.shape[-1])[0] if value.ndim else np.full(len(fed), int(value))


def _golden_for(sl: RotarySlice, mf: ModelFile, rope: RopeConfig | None, position_limit: int | None,
                runner_names, max_in_memory: int):
    """(golden, the positions' upper end) or (None, why not)."""
    stored = sl.tables
    limit = int(mf.initializer(stored["cos"]).dims[0]) if stored else position_limit
    from_table = limit is None and not sl.chosen.position_ids and sl.table_rows is not None
    if from_table:  # per-token caches cut from a table (Meta's freqs_cis): no position past its last row
        limit = sl.table_rows
    if limit is None and rope is not None:
        return None, "the file records no position range and the node reads no stored cache"
    cache_type = mf.value_type(sl.chosen.cos)
    half_slack = HALF_CACHE_SLACK.get(str(cache_type.dtype) if cache_type else "", 0.0)
    if rope is not None:
        in_graph = not stored
        theta = float((inv_freq_and_scaling(rope, limit)[0]).abs().max()) if in_graph else 0.0
        return _Golden("configuration", rope=rope, limit=None if in_graph else limit,
                       slack_per_position=theta * FLOAT32_ANGLE_SLACK if in_graph else 0.0, slack=half_slack), limit
    if stored:
        import torch

        tables = tuple(torch.from_numpy(mf.tensor(stored[r]).astype(np.float32)) for r in ("cos", "sin"))
        return _Golden("tables", tables=tables, limit=limit), limit
    try:
        runner, _ = make_runner("onnx-reference", ModelFile.open(sl.model), limits=Limits(max_in_memory=max_in_memory))
    except Skip as why:
        return None, f"no RoPE configuration or stored cache to compare with, and no golden ({why})"
    return _Golden("runner", runner=runner, limit=limit, from_table=from_table), limit or PEER_SWEEP


def sweep(mf: ModelFile, slices: list[RotarySlice], runner_names, *, ropes: list[RopeConfig | None],
          position_limit: int | None, out_of_range_allowed: bool, plugin_library=None, max_in_memory: int,
          say=lambda message: None, seed: int = 7) -> tuple[dict[str, SweepResult], list[str]]:
    """``ropes``: each slice's RoPE configuration (``layer_rope.slice_ropes``), None where the file has none."""
    results = {name: SweepResult(name) for name in runner_names}
    notes = []
    rng = np.random.default_rng(seed)
    for sl, rope in zip(slices, ropes, strict=True):
        golden, limit = _golden_for(sl, mf, rope, position_limit, runner_names, max_in_memory)
        if golden is None:
            notes.append(f"{sl.label}: not swept: {limit}")
            continue
        if golden.kind == "runner":
            why = (f"no RoPE configuration in the file; its caches are cut from a table of {limit} rows"
                   if golden.from_table else
                   f"no RoPE configuration{'' if golden.limit else ' or position range'} in the file")
            notes.append(f"{sl.label}: run alone over positions 0..{limit - 1} and compared with onnx-reference "
                         f"({why})")
        # per-token caches cut from a table have no row past its end
        cut = not sl.chosen.position_ids and (golden.from_table or sl.table is not None)
        passes = out_of_range_allowed and golden.limit is not None and not cut and (
            sl.chosen.kind in CONTRACT_KINDS or not sl.chosen.position_ids)
        width = int(np.prod([d for d in sl.x.dims if isinstance(d, int)]))
        fixed = _fixed_seq(sl)
        if fixed is not None and fixed > limit:
            notes.append(f"{sl.label}: not swept: the file fixes its sequence at {fixed} tokens, more than the "
                         f"{limit} positions to sweep")
            continue
        if not sl.chosen.position_ids and not sl.position_inputs:  # no input steers them: token i is at i
            longest = fixed or max(1, CHUNK_ELEMENTS // max(width, 1))
            if limit > longest:
                notes.append(f"{sl.label}: swept over positions 0..{longest - 1} of {limit} only: its positions are "
                             f"the tokens' indices (no input sets them), and one run takes at most {longest} tokens")
            chunks = [np.arange(min(limit, longest))]
        else:
            if fixed is not None:
                notes.append(f"{sl.label}: run alone {fixed} tokens at a time (the file's static sequence length)")
            chunks = _chunks(limit, width, passes, fixed)
        slice_file = ModelFile.open(sl.model)
        runners = {}
        for name in runner_names:
            if golden.kind == "runner" and name == "onnx-reference":
                results[name].status = "golden"
                continue
            try:
                runners[name], _ = make_runner(name, slice_file, plugin_library=plugin_library,
                                               limits=Limits(max_in_memory=max_in_memory))
            except Skip as why:
                results[name].reason = results[name].reason or str(why)
            except Exception as exc:  # noqa: BLE001
                results[name].fail(f"{sl.label}: cannot run the node alone: {first_line(exc)}")
        if not runners:
            continue
        try:
            read = _PositionsRead(sl)
        except Exception as exc:  # noqa: BLE001 - onnx.reference cannot run what computes the positions
            notes.append(f"{sl.label}: not swept: the positions it reads are computed in the graph by nodes "
                         f"onnx.reference cannot run ({first_line(exc)})")
            continue
        say(f"sweeping {sl.label} over positions 0..{limit - 1}{' and out of range' if passes else ''} on "
            f"{', '.join(runners)}")
        _run_sweep(sl, golden, chunks, runners, results, rng, limit, read)
        del runners
    for result in results.values():
        result.finish()
    return results, notes


def _run_sweep(sl, golden: _Golden, chunks, runners: dict, results: dict[str, SweepResult], rng, limit: int,
               read: _PositionsRead) -> None:
    rank = len(sl.x.dims)
    tol = tolerance("op", str(sl.x.dtype))
    active, started = {}, []
    for name, runner in runners.items():
        try:
            runner.activate()
            active[name] = runner
            started.append(runner)
        except Exception as exc:  # noqa: BLE001 - a runner that cannot load the slice fails the sweep
            results[name].fail(f"{sl.label}: cannot run the node alone: {first_line(exc)}")
    for name in active:
        results[name].slices += 1
    if golden.kind == "runner":
        golden.runner.activate()
    bad: dict[str, list] = {name: [] for name in active}
    output = sl.chosen.node.output[0]
    covered = {name: np.zeros(limit, bool) for name in active}
    try:
        for fed in chunks:
            feeds = _slice_feeds(sl, fed, rng)
            x = feeds[sl.x.name]
            try:
                positions = read(feeds, fed)  # what the node reads, where the graph computes it from the feeds
                if golden.kind == "runner":
                    want = _per_token(golden.runner.infer(feeds)[output], rank)
                else:
                    want = _rotate(golden, sl, x, positions[None, :])
            except Exception as exc:  # noqa: BLE001 - e.g. a configuration whose width does not fit the node
                for name in active:
                    results[name].fail(f"{sl.label}: no expected rotation for it ({first_line(exc)})")
                return
            x_max = np.abs(_per_token(x, rank)).max(axis=1)
            allowed_slack = x_max * (golden.slack + golden.slack_per_position * np.maximum(positions, 0))
            for name, runner in list(active.items()):
                r = results[name]
                try:
                    got = _per_token(runner.infer(feeds)[output], rank)
                except Exception as exc:  # noqa: BLE001
                    r.fail(f"{sl.label}: failed at positions {positions[0]}..{positions[-1]}: {first_line(exc)}")
                    del active[name]
                    continue
                err = np.abs(np.nan_to_num(got - want, nan=np.inf))
                token_err = err.max(axis=1)
                token_ratio = limit_ratio(got, want, tol, allowed_slack[:, None]).max(axis=1)
                over = token_ratio > 1
                bad[name] += [int(p) for p in positions[over]]
                r.position_error.add(positions, token_err, token_ratio)
                r.max_abs = max(r.max_abs or 0.0, float(token_err.max(initial=0.0)))
                inside = (positions >= 0) & (positions < limit)
                fresh = np.unique(positions[inside])  # runs of a static length overlap at the end
                r.positions += int((~covered[name][fresh]).sum())
                covered[name][fresh] = True
                r.out_of_range += int((~inside).sum())
    finally:
        for runner in started:
            runner.deactivate()
        if golden.kind == "runner":
            golden.runner.deactivate()
    for name, positions in bad.items():
        if positions:
            results[name].fail(f"{sl.label}: positions {describe_ranges(row_ranges(positions))} differ from "
                               f"{'the RoPE configuration' if golden.kind == 'configuration' else golden.kind}")
