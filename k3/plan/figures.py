"""A plan's result: named figures, each with its unit, in the order they are reported; printed as an
aligned table or emitted as JSON."""

from __future__ import annotations

from dataclasses import dataclass, field

UNITS = {"bytes": 1e9, "FLOP": 1e9, "FLOP/s": 1e12}  # shown in GB, GFLOP and TFLOP/s


@dataclass
class Figures:
    """Figures under a heading, settings beside them (`inputs`, with which ones the planner chose)."""

    title: str
    inputs: dict[str, object] = field(default_factory=dict)
    chosen: list[str] = field(default_factory=list)  # inputs the planner set (not given on the command line)
    values: dict[str, tuple[float, str]] = field(default_factory=dict)  # name -> (value, unit)
    notes: list[str] = field(default_factory=list)

    def add(self, name: str, value: float, unit: str) -> float:
        self.values[name] = (value, unit)
        return value

    def __getitem__(self, name: str) -> float:
        return self.values[name][0]

    def to_json(self) -> dict:
        return {
            "title": self.title,
            "inputs": self.inputs,
            "chosen_by_planner": self.chosen,
            "figures": {name: {"value": v, "unit": u} for name, (v, u) in self.values.items()},
            "notes": self.notes,
        }

    def format(self) -> str:
        lines = [self.title]
        settings = [f"{k} {v}" + (" (planner)" if k in self.chosen else "") for k, v in self.inputs.items()]
        lines += ["  " + ", ".join(settings[i : i + 4]) for i in range(0, len(settings), 4)]
        width = max(map(len, self.values), default=0)
        for name, (value, unit) in self.values.items():
            lines.append(f"  {name:<{width}}  {_show(value, unit)}")
        lines += [f"  {note}" for note in self.notes]
        return "\n".join(lines)


def _show(value: float, unit: str) -> str:
    if unit in UNITS:
        scale = UNITS[unit]
        prefix = {1e9: "G", 1e12: "T"}[scale]
        shown = {"bytes": "B"}.get(unit, unit)
        return f"{value / scale:,.2f} {prefix}{shown}"
    if unit == "bool":
        return "yes" if value else "no"
    if unit in ("count", "tokens", "sequences", "GPUs", "steps", "micro-batches", "GPU-hours", "nodes"):
        return f"{value:,.0f} {unit}"
    if unit == "s" and value >= 3600:
        return f"{value:,.0f} s ({value / 3600:,.1f} hours, {value / 86400:,.2f} days)"
    return f"{value:,.4g} {unit}"
