"""Presets: which projections of which recovery block get W and D, and what else trains.

A preset is data. Block ``i`` of a recovery module uses ``blocks[min(i, len(blocks)-1)]``,
so a two-entry preset covers modules of any depth (the last entry repeats). In YAML::

    name: my-preset
    blocks:
      - {train_base: true,  w: [q, k, v, o], d: [gate, up, down]}
      - {train_base: false, w: [q, k, v, o, gate, up, down], d: [q, k, v, o, gate, up, down]}
    anneal: true            # use the annealed activation between W and D (Hybrid + A_s)
    d_side: {o: input, down: input}   # optional; defaults below

Built-in presets are the reference default ``hybrid`` (paper Table ``tab:ablation``, last
row) and every ablation row of that table.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path


from .arch import ALL_PROJ, ATTN_PROJ, KNOWN_PROJ, MLP_PROJ
from ..errors import OverRepError
from ..yamlio import read_yaml

# Expanding projections take D on the output side, contracting ones on the input side. A
# Mamba-2 mixer's in_proj (key 'in', named only by custom presets) defaults to its input
# side, hidden x hidden (see overrep.model.mamba); it is not listed here so that the
# built-in presets' dicts stay as they were.
MAMBA_D_SIDE = {"in": "input"}
DEFAULT_D_SIDE = {"q": "output", "k": "output", "v": "output", "o": "input",
                  "gate": "output", "up": "output", "down": "input"}


@dataclass(frozen=True)
class BlockSpec:
    """One recovery block: trainable pretrained weights? W / D on which projections?"""

    train_base: bool = False
    w: tuple[str, ...] = ()
    d: tuple[str, ...] = ()
    norm_reparam: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "w", tuple(self.w))
        object.__setattr__(self, "d", tuple(self.d))
        bad = [p for p in self.w + self.d if p not in KNOWN_PROJ]
        if bad:
            raise OverRepError(f"unknown projection(s) {bad} in preset; use {list(KNOWN_PROJ)}")


@dataclass(frozen=True)
class Preset:
    name: str
    blocks: tuple[BlockSpec, ...]
    anneal: bool = True
    d_side: dict = field(default_factory=lambda: dict(DEFAULT_D_SIDE))
    train_final_norm: bool = True
    description: str = ""

    def block(self, i: int) -> BlockSpec:
        return self.blocks[min(i, len(self.blocks) - 1)]

    def side(self, key: str) -> str:
        """The side D takes on projection ``key`` (``d_side``, else the Mamba default)."""
        return self.d_side.get(key) or MAMBA_D_SIDE[key]

    @property
    def uses_d(self) -> bool:
        return any(b.d for b in self.blocks)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["blocks"] = [{**b, "w": list(b["w"]), "d": list(b["d"])} for b in d["blocks"]]
        return d

    @classmethod
    def from_dict(cls, data: dict) -> "Preset":
        data = dict(data)
        unknown = set(data) - {"name", "blocks", "anneal", "d_side", "train_final_norm", "description"}
        if unknown:
            raise OverRepError(f"unknown preset field(s) {sorted(unknown)}")
        if not data.get("blocks"):
            raise OverRepError("a preset needs at least one entry under 'blocks'")
        blocks = tuple(BlockSpec(**b) for b in data.pop("blocks"))
        side = {**DEFAULT_D_SIDE, **data.pop("d_side", {})}
        if any(v not in ("output", "input") for v in side.values()):
            raise OverRepError("d_side values must be 'output' or 'input'")
        return cls(name=data.pop("name", "custom"), blocks=blocks, d_side=side, **data)


def _preset(name: str, description: str, b1: BlockSpec, b2: BlockSpec, anneal: bool = True) -> Preset:
    return Preset(name=name, blocks=(b1, b2), anneal=anneal, description=description)


def _both(w=(), d=()) -> tuple[BlockSpec, BlockSpec]:
    # Ablation rows: the component on both blocks, block 1 pretrained weights trainable,
    # block 2 pretrained weights frozen (as in the hybrid preset).
    return BlockSpec(True, w, d), BlockSpec(False, w, d)


BUILTIN_PRESETS: dict[str, Preset] = {p.name: p for p in [
    _preset("hybrid", "reference default: block 1 trainable with W on attention and D on the MLP; "
            "block 2 frozen with W and D everywhere; annealed activation",
            BlockSpec(True, ATTN_PROJ, MLP_PROJ), BlockSpec(False, ALL_PROJ, ALL_PROJ)),
    _preset("hybrid-linear", "hybrid without the annealed activation (ablation 'Hybrid')",
            BlockSpec(True, ATTN_PROJ, MLP_PROJ), BlockSpec(False, ALL_PROJ, ALL_PROJ), anneal=False),
    Preset("hybrid-narrow", (BlockSpec(True, ATTN_PROJ, MLP_PROJ), BlockSpec(False, ALL_PROJ, ALL_PROJ)),
           d_side={**DEFAULT_D_SIDE, "gate": "input", "up": "input", "down": "output"},
           description="hybrid with the MLP's D on its hidden-size side (input of gate/up, output of down): "
                       "D is hidden x hidden instead of intermediate x intermediate, a cheaper step"),
    Preset("width", (BlockSpec(False, ALL_PROJ, ALL_PROJ),),
           description="width pruning (paper appendix 'OverRep in Channel-wise Pruning'): every block keeps P frozen "
                       "and trains W and D on all projections, D rectangular on the narrowed side"),
    Preset("width-linear", (BlockSpec(False, ALL_PROJ, ALL_PROJ),), anneal=False,
           description="width without the annealed activation: W and D stay linear, so every step is the "
                       "folded, width-pruned model (for short budgets, whose alpha schedule is a few steps)"),
    _preset("plain", "no W or D: block 1 fine-tuned, block 2 frozen (ablation 'Plain')", *_both()),
    _preset("plain-full", "no W or D: every recovery block fine-tuned",
            BlockSpec(True), BlockSpec(True)),
    _preset("attn-w", "ablation 'Attn W'", *_both(w=ATTN_PROJ)),
    _preset("attn-d", "ablation 'Attn D'", *_both(d=ATTN_PROJ)),
    _preset("mlp-w", "ablation 'MLP W'", *_both(w=MLP_PROJ)),
    _preset("mlp-d", "ablation 'MLP D'", *_both(d=MLP_PROJ)),
    _preset("w-only", "ablation 'W only'", *_both(w=ALL_PROJ)),
    _preset("d-only", "ablation 'D only'", *_both(d=ALL_PROJ)),
    _preset("uniform", "ablation 'Uniform': W and D everywhere on both blocks", *_both(w=ALL_PROJ, d=ALL_PROJ)),
]}


def get_preset(name_or_path: str | dict | Preset) -> Preset:
    """A built-in preset by name, a preset dict, or a YAML file defining one."""
    if isinstance(name_or_path, Preset):
        return name_or_path
    if isinstance(name_or_path, dict):
        return Preset.from_dict(name_or_path)
    if name_or_path in BUILTIN_PRESETS:
        return BUILTIN_PRESETS[name_or_path]
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        return Preset.from_dict(read_yaml(path, "preset file"))
    raise OverRepError(f"unknown preset '{name_or_path}'; built-in: {', '.join(BUILTIN_PRESETS)} "
                       "(or a .yaml file)")
