"""Filling a model built on the meta device (and given memory) from a checkpoint's tensors, one at a time
(`k3.checkpoints.loading`): each tensor checked as it comes, and what does not fit reported together at
the end, one line:

- names and shapes: what is missing, unexpected or of another shape (`checkpoint.raise_mismatch`), with
  config.json's fields behind the shapes named (`checkpoint.fields_behind`);
- dtypes: integer or bool tensors where the model holds floating-point weights, anything but uint8 for
  MXFP4 codes and scales (`checkpoint.dtype_problem`), known from the headers before any data is read;
- values: NaN or infinity, as the model holds them (a cast that overflows counts), by one min/max
  reduction per tensor whose results are read once at the end (`checkpoint.values_flag`).

`strict=False` loads dtypes (cast) and values that would be refused, with a warning; names and shapes
are never loaded past.
"""

from __future__ import annotations

import re

import torch

from ..ops import mxfp4
from . import checkpoint, hf_config, kimi_k3_format

EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.")


class Filler:
    """Copies named tensors into a model's state, checking them (the module docstring), pairing MXFP4
    halves. `source`: what errors name; `native`: a k3 config.json (else a Kimi one, whose field names
    the errors use); `probe`: `checkpoint.fields_behind`'s, for the model's kind."""

    def __init__(self, model: torch.nn.Module, source: str, native: bool, strict: bool, probe):
        self.model, self.source, self.native, self.strict, self.probe = model, source, native, strict, probe
        self.own = model.state_dict()
        self.unexpected: list[str] = []
        self.read: dict[str, tuple] = {}  # the shape of each model tensor the checkpoint holds
        self.halves: dict[str, dict[str, torch.Tensor]] = {}  # expert matrix -> the MXFP4 parts seen so far
        self.file = ""  # the file being read, named in what is refused
        self.dtypes: list[str] = []
        self.flags: dict[str, tuple] = {}  # key -> its values' checkpoint.values_flag (read at the end)
        self.files: dict[str, str] = {}  # key -> the file it came from
        self.values: list[str] = []  # values refused as read

    def held_elsewhere(self, key: str) -> bool:
        """True for a routed expert's tensor that this process does not hold (expert parallelism leaves
        such experts None): it is neither read nor expected."""
        m = EXPERT_KEY.match(key)
        if m is None or key in self.own:
            return False
        layers = self.model.model.layers
        layer, expert = int(m.group(1)), int(m.group(2))
        if layer >= len(layers) or not hasattr(layers[layer].ffn, "experts"):
            return False
        experts = layers[layer].ffn.experts
        return expert < len(experts) and experts[expert] is None

    def put(self, key: str, t: torch.Tensor) -> None:
        part = next((p for p in kimi_k3_format.QUANTIZED_PARTS if key.endswith(p)), None)
        if part is not None and key not in self.own:  # MXFP4 in the file, full precision in the model
            base = key[: -len(part)]
            halves = self.halves.setdefault(base, {})
            halves[part] = t
            if len(halves) == 2:
                del self.halves[base]
                packed, scale = halves[".weight_packed"], halves[".weight_scale"]
                try:
                    self._copy(base, mxfp4.decode(packed, scale))
                except ValueError as e:  # codes and scales that are not uint8, or do not pair up
                    raise ValueError(f"{self.source}: {self.file}: {base}: {e}") from None
            return
        if key not in self.own and key + ".weight_packed" in self.own:  # full precision in, MXFP4 kept
            if not self._usable(key, t, t.new_empty((), dtype=torch.float32)):  # encoded from floating point
                for half in (".weight_packed", ".weight_scale"):  # refused for its dtype, not missing
                    self.read[key + half] = tuple(self.own[key + half].shape)
                return
            t = t if t.is_floating_point() else t.float()
            if not t.is_meta and checkpoint.unusable({key: checkpoint.values_flag(key, t)}):  # the file's, on the CPU
                self.values.append(f"{key} ({self.file}): {checkpoint.values_problem(t)}")
            packed, scale = mxfp4.encode(t)
            self._copy(key + ".weight_packed", packed)
            self._copy(key + ".weight_scale", scale)
            return
        self._copy(key, t)

    def _usable(self, key: str, t: torch.Tensor, own: torch.Tensor) -> bool:
        """False for a dtype that `own` cannot take from `t` (noted; with strict=False a floating `own`
        takes any dtype, cast)."""
        problem = checkpoint.dtype_problem(t, own)
        if problem is not None:
            self.dtypes.append(f"{key} ({self.file}): {problem}")
        return problem is None or (not self.strict and own.is_floating_point())

    def _copy(self, key: str, t: torch.Tensor) -> None:
        own = self.own.get(key)
        if own is None:
            self.unexpected.append(key)
            return
        self.read[key] = tuple(t.shape)
        if own.shape == t.shape and self._usable(key, t, own):
            with torch.no_grad():
                own.copy_(t)
            if not own.is_meta:  # checked as held: a cast that overflows counts too
                self.flags[key], self.files[key] = checkpoint.values_flag(key, own), self.file

    def finish(self, tied: bool, values: bool = True) -> None:
        """Raise what does not fit: names and shapes first, config.json's fields behind the shapes named;
        then (`values`) dtypes and values that are no number (with strict=False, a warning)."""
        read = dict(self.read)
        if tied and "model.embed_tokens.weight" in read:
            read["lm_head.weight"] = read["model.embed_tokens.weight"]
        self.unexpected += [base + part for base, halves in self.halves.items() for part in halves]
        wrong = sorted(k for k, shape in read.items() if shape != tuple(self.own[k].shape))
        shapes = [f"{k}: checkpoint {list(read[k])}, model {list(self.own[k].shape)}" for k in wrong]
        fields = None
        if wrong:
            model = {k: tuple(t.shape) for k, t in self.own.items()}
            name = (lambda f: f) if self.native else hf_config.hf_field_name
            fields = checkpoint.fields_behind(self.model.config, read, model, self.probe, name)
        missing = sorted(set(self.own) - set(read))
        checkpoint.raise_mismatch(self.source, missing, sorted(self.unexpected), shapes, fields)
        if values:
            bad = checkpoint.unusable(self.flags)
            found = [f"{k} ({self.files[k]}): {checkpoint.values_problem(self.own[k])}" for k in bad]
            # the warning points at from_pretrained's caller (finish < load_pretrained < from_pretrained)
            checkpoint.refuse_values(self.source, self.dtypes, self.values + found, self.strict, stacklevel=5)
