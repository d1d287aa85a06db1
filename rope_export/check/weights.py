"""Which weights check rebuilds the transformers reference with: export --hf's rule, and the file's record.

Comparing a trained export with random weights (or a random export with trained ones) fails or, worse,
passes for the wrong reason. So:

* ``--weights DIR`` / ``--random-weights`` are obeyed;
* otherwise an ``export --hf`` file is compared with what it records: the weights folder it was exported
  from, or random weights of its seed, even when the ``--hf`` folder holds a checkpoint;
* a file that records nothing (no transformers metadata) is compared as ``export --hf CONFIG`` would
  build it: the checkpoint beside the config, else random weights (seed).

Whenever what is compared differs from what the file records, or random weights stand in for a
trained model that nothing records, one note says so (the report's notes, and the reference label
names the weights), so no PASS or FAIL is silently about other weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from rope_export.check.model_file import CheckError


@dataclass
class WeightsChoice:
    folder: str | None  # None: random weights of ``seed``
    seed: int
    note: str = ""  # one line, when what is compared is not simply what the file records

    def describe(self) -> str:
        return f"random weights (seed {self.seed})" if self.folder is None else f"the weights in {self.folder}"

    def to_dict(self) -> dict:
        """For --summary-json: where the reference's weights came from."""
        from rope_export.hf.checkpoints import weights_fact

        return weights_fact(self.folder, self.seed)


_UNRECORDED = object()


def choose_weights(*, recorded=_UNRECORDED, recorded_seed: int = 0, hf_config=None, weights=None,
                   random_weights: bool = False, seed: int | None = None) -> WeightsChoice:
    """The reference's weights. ``recorded``: the file's record (a folder path, None for random weights) or
    nothing (a file without transformers metadata); ``hf_config``: a --hf path (None: the recorded config)."""
    if random_weights and weights is not None:
        raise CheckError("--random-weights and --weights exclude each other: give one")
    has_record = recorded is not _UNRECORDED
    record = WeightsChoice(None if recorded is None else str(recorded), recorded_seed) if has_record else None
    if weights is not None or random_weights:  # asked for: obeyed, and any difference from the record said
        chosen = WeightsChoice(None if weights is None else str(weights), recorded_seed if seed is None else seed)
        if record is not None and not _same(record, chosen):
            chosen.note = (f"the file was exported with {record.describe()} but is compared with {chosen.describe()}, "
                           "as asked: a FAIL means they differ, not that the export is wrong")
        return chosen
    if record is not None:
        return _follow_record(record, hf_config, seed)
    beside = _beside(hf_config)
    if beside is not None:
        return WeightsChoice(str(beside), seed or 0)
    return WeightsChoice(None, seed or 0, f"random weights (seed {seed or 0}): the file records no weights and "
                                          f"{hf_config} holds no checkpoint, so a file exported from a trained model "
                                          "fails; give --weights DIR")


def _follow_record(record: WeightsChoice, hf_config, seed: int | None) -> WeightsChoice:
    beside = _beside(hf_config)
    if record.folder is None:
        chosen = WeightsChoice(None, record.seed if seed is None else seed)
        if seed is not None and seed != record.seed:
            chosen.note = f"the file was exported with random weights of seed {record.seed}, compared with seed {seed}"
        elif beside is not None:
            chosen.note = (f"the file was exported with random weights (seed {record.seed}) and is compared with "
                           f"those, not with the checkpoint in {beside}; pass --weights {beside} to compare with it")
        return chosen
    if Path(record.folder).is_dir():
        chosen = WeightsChoice(record.folder, record.seed)
        if beside is not None and not _same_folder(beside, record.folder):
            chosen.note = (f"compared with the weights the file records ({record.folder}), not the checkpoint in "
                           f"{beside}; pass --weights {beside} to compare with those")
        return chosen
    if beside is not None:
        return WeightsChoice(str(beside), record.seed, f"the weights folder the file records ({record.folder}) is not "
                                                       f"there; compared with the checkpoint in {beside}")
    raise CheckError(f"the weights folder the file records ({record.folder}) is not there; pass --weights DIR with "
                     "the model's checkpoint")


def _beside(hf_config) -> Path | None:
    """The checkpoint folder beside a --hf path (None for none, or a config from the metadata)."""
    if not isinstance(hf_config, (str, os.PathLike)):
        return None
    from rope_export.hf.loading import weights_beside

    try:
        return weights_beside(hf_config)
    except ValueError as exc:  # weights in a form rope-export does not read
        raise CheckError(f"{exc}") from None


def _same(a: WeightsChoice, b: WeightsChoice) -> bool:
    if a.folder is None or b.folder is None:
        return a.folder is None and b.folder is None and a.seed == b.seed
    return _same_folder(a.folder, b.folder)


def _same_folder(a, b) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return str(a) == str(b)
